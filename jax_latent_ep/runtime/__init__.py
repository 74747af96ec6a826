"""What the NVLink backend runs on: the FFI library, symmetric buffers and their key-value rendezvous, the compiled
artifacts and the ahead-of-time build. No JAX at import (the build runs without it).
"""
