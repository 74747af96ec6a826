"""The kernel sources that decide the cubins, and their hash (a manifest's `source_sha256`, the kernel cache key)."""

from __future__ import annotations

import hashlib
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
#: Files whose content decides the cubins (every kernel module, the ABI, the layouts and shapes they build on): their
#: sha256 is recorded as `source_sha256`.
SOURCES = tuple(sorted(f"kernels/{p.name}" for p in (PACKAGE_DIR / "kernels").glob("*.py"))) + ("layout.py", "shapes.py")


def source_sha256() -> str:
    """sha256 over `SOURCES` (name and bytes, in order)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0")
        digest.update((PACKAGE_DIR / name).read_bytes())
    return digest.hexdigest()
