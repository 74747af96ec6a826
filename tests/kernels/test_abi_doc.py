"""docs/kernel_abi.md carries the tables of the kernel ABI exactly as `jax_latent_ep.kernels.abi.markdown()` writes
them, between its `<!-- abi:begin -->` / `<!-- abi:end -->` markers."""

import os

from jax_latent_ep.kernels import abi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "kernel_abi.md")
BEGIN, END = "<!-- abi:begin -->\n", "<!-- abi:end -->"


def generated_block(text: str) -> str:
    """The text between the markers (each exactly once, begin before end)."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{DOC}: want one {BEGIN.strip()} and one {END}"
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    assert start <= stop, f"{DOC}: {END} comes before {BEGIN.strip()}"
    return text[start:stop]


def test_kernel_abi_doc_matches_the_declaration():
    with open(DOC) as f:
        block = generated_block(f.read())
    assert block == abi.markdown(), (
        "docs/kernel_abi.md's ABI tables differ from jax_latent_ep/kernels/abi.py: replace the text between the "
        "markers with the output of `python -m jax_latent_ep.kernels.abi --markdown`")


def test_the_doc_names_every_parameter_and_error_code():
    with open(DOC) as f:
        block = generated_block(f.read())
    for kernel in abi.KERNELS.values():
        assert f"`{kernel.symbol}`" in block
        assert all(f"`{p.name}`" in block for p in kernel.params)
    assert all(f"`ERROR_{e.name}`" in block for e in abi.ERRORS)
