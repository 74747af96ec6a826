"""The SASS instructions of a kernel's innermost loop, by opcode: the static count behind "issue-bound" claims.

    python -m tools.sass_loop grouped_matmul_fp8_wide [--around QGMMA] [--nth 0] [--arch sm_90a]
    python -m tools.sass_loop path/to/kernel.cubin --around LDGSTS     # a built cubin (another tree's, say)
    python -m tools.sass_loop path/to/kernel.cubin --spills            # where its local-memory accesses sit

A kernel name (one of `runtime.build.SHAPE_FREE`) is compiled into a temporary folder first (cutlass-dsl). The loop
is the smallest one holding the `nth` instruction whose text contains `--around` (`QGMMA`: a consumer's `wgmma`
loop; `LDGSTS`: a producer's `cp.async` loop): from a label to the last backward branch to it. Needs `nvdisasm`
(on the PATH, `--nvdisasm`, or `pip install nvidia-cuda-nvdisasm`). Counts are per thread of one pass of the loop
(one ring stage): instructions a warp issues, not their latency. `--spills` lists each spill store and reload
(`STL`, `LDL`) with the length of the smallest loop holding it: a spill outside the hot loop costs little.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def _instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """`(instruction texts, label -> index of the instruction after it)` of an nvdisasm listing."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = _INSTRUCTION.match(line)
        if found:
            instructions.append(re.sub(r"\s*\(\*.*?\*\)", "", found.group(2)).strip())  # no `(*"..."*)` notes
    return instructions, labels


def innermost_loop(sass: str, around: str = "QGMMA", nth: int = 0) -> list[str]:
    """The instructions (text, predicate included) of the smallest loop of `sass` (nvdisasm's listing) that holds
    the `nth` instruction containing `around`; ValueError naming `around` where there is no such instruction or
    loop."""
    instructions, labels = _instructions(sass)
    hits = [k for k, text in enumerate(instructions) if around in text]
    if len(hits) <= nth:
        raise ValueError(f"around={around!r}: {len(hits)} such instructions, nth={nth} asked")
    span = _smallest_loop(instructions, labels, hits[nth])
    if span is None:
        raise ValueError(f"around={around!r}: instruction {hits[nth]} is in no loop")
    return instructions[span[0]:span[1] + 1]


def _smallest_loop(instructions: list[str], labels: dict[str, int], at: int) -> tuple[int, int] | None:
    """`(first, last)` instruction of the smallest loop holding instruction `at` (a label to its last backward
    branch), or None."""
    best = None
    for k in range(at, len(instructions)):
        branch = _BRANCH.search(instructions[k])
        if branch and labels.get(branch.group(1), len(instructions)) <= at:
            start = labels[branch.group(1)]
            if best is None or k - start < best[1] - best[0]:
                best = (start, k)
    return best


def spill_loops(sass: str) -> list[tuple[str, int | None]]:
    """Each local-memory access (`STL`, `LDL`) of `sass` in listing order, with the instruction count of the
    smallest loop that holds it (None: in no loop)."""
    instructions, labels = _instructions(sass)
    found = []
    for k, text in enumerate(instructions):
        if re.match(r"(@!?U?P\w+\s+)?(STL|LDL)\b", text):
            span = _smallest_loop(instructions, labels, k)
            found.append((text, None if span is None else span[1] - span[0] + 1))
    return found


def opcode_counts(instructions: list[str]) -> collections.Counter:
    """Instructions by opcode, without predicate or modifiers (`@!P0 LDGSTS.E.BYPASS.128 ...` counts as LDGSTS)."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in instructions)


def find_nvdisasm(path: str | None = None) -> str:
    """`path`, else `nvdisasm` on the PATH, else the one `pip install nvidia-cuda-nvdisasm` put beside Python."""
    candidates = [path] if path else [shutil.which("nvdisasm"), *sorted(glob.glob(os.path.join(
        sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", "nvdisasm")))]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("nvdisasm not found: --nvdisasm PATH, or `pip install nvidia-cuda-nvdisasm`")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kernel", help="a cubin's path, or a kernel of runtime.build.SHAPE_FREE to compile")
    p.add_argument("--around", default="QGMMA", help="text of an instruction in the loop (QGMMA, LDGSTS, HMMA, ...)")
    p.add_argument("--nth", type=int, default=0, help="which such instruction, in listing order")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--nvdisasm", default=None)
    p.add_argument("--spills", action="store_true", help="each STL / LDL and the length of its smallest loop")
    args = p.parse_args(argv)
    nvdisasm = find_nvdisasm(args.nvdisasm)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = args.kernel
        if not os.path.exists(cubin):
            from jax_latent_ep.runtime import build

            if args.kernel not in build.SHAPE_FREE:
                raise SystemExit(f"{args.kernel!r}: no such file, and not one of {sorted(build.SHAPE_FREE)}")
            cubin = os.path.join(tmp, build.compile_shape_free(args.kernel, args.arch, tmp)["file"])
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    if args.spills:
        spills = spill_loops(sass)
        print(f"{args.kernel}: {len(spills)} local-memory accesses")
        for text, loop_length in spills:
            print(f"  {text}: " + (f"in a loop of {loop_length} instructions" if loop_length else "in no loop"))
        return 0
    loop = innermost_loop(sass, args.around, args.nth)
    counts = opcode_counts(loop)
    print(f"{args.kernel}: loop around {args.around} #{args.nth}: {len(loop)} instructions; "
          + ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
