"""The kernel sources that decide the cubins, and their hash (a manifest's `source_sha256`, the kernel cache key)."""

from __future__ import annotations

import hashlib
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
#: Files whose content decides the cubins: their sha256 is recorded as `source_sha256`.
SOURCES = ("kernels/__init__.py", "kernels/abi.py", "kernels/common.py", "kernels/primitives.py", "kernels/dispatch.py",
           "kernels/combine.py", "kernels/grouped_gemm.py", "kernels/expert_plan.py", "kernels/row_sum.py",
           "layout.py", "shapes.py")


def source_sha256() -> str:
    """sha256 over the kernel sources (kernels/*.py, layout.py, shapes.py: name and bytes, in order)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0")
        digest.update((PACKAGE_DIR / name).read_bytes())
    return digest.hexdigest()
