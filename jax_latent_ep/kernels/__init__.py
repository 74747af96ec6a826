"""CuTe DSL kernels of the EP dispatch / combine (compiled ahead of time by `jax_latent_ep.runtime.build`; no JAX here).

primitives.py: memory-ordering, raw-pointer and bit helpers; common.py: device layout, the flag protocol and
`compile_cubin`; dispatch.py, combine.py: one kernel family each.
"""
