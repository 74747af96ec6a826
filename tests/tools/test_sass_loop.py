"""`tools.sass_loop`: the innermost loop around an instruction of an nvdisasm listing, counted by opcode."""

import random

import pytest

from tools.sass_loop import innermost_loop, opcode_counts


def _listing(body_ops, seed):
    """An nvdisasm-like listing: a prologue, an outer loop holding an inner loop of `body_ops` (with a forward
    branch and a predicated copy inside), an epilogue; addresses every 16 bytes. Returns (text, the inner loop's
    instructions)."""
    rng = random.Random(seed)
    lines, inner, address = [], [], 0

    def emit(text, into=None):
        nonlocal address
        lines.append(f"        /*{address:04x}*/                   {text} ;")
        address += 16
        if into is not None:
            into.append(text)

    emit("S2R R0, SR_TID.X")
    lines.append(".L_x_1:")
    emit("IADD3 R1, R1, 0x1, RZ")
    lines.append(".L_x_2:")
    for op in body_ops:
        emit(f"{op} R{rng.randrange(8)}, R{rng.randrange(8)}", inner)
    emit("@!P0 BRA `(.L_x_3)", inner)  # forward: not the loop's
    emit("@P1 LDGSTS.E.BYPASS.128 [R4], desc[UR4][R2.64]", inner)
    lines.append(".L_x_3:")
    emit("@!P2 BRA `(.L_x_2)", inner)  # the inner loop's back edge
    emit("ISETP.NE.AND P3, PT, R1, R5, PT")
    emit("@P3 BRA `(.L_x_1)")  # the outer loop's
    emit("EXIT")
    return "\n".join(lines), inner


def test_innermost_loop_counts_each_opcode_once_a_pass():
    ops = ["FFMA"] * 7 + ["QGMMA.64x128x32.F32.E4M3.E4M3"] * 2 + ["LOP3.LUT"] * 3
    random.Random(1).shuffle(ops)
    text, inner = _listing(ops, seed=2)
    loop = innermost_loop(text, "QGMMA")
    assert loop == inner
    assert opcode_counts(loop) == {"FFMA": 7, "QGMMA": 2, "LOP3": 3, "BRA": 2, "LDGSTS": 1}
    assert innermost_loop(text, "QGMMA", nth=1) == inner
    assert len(innermost_loop(text, "ISETP")) == len(inner) + 3  # the outer loop: its label to its back edge


def test_innermost_loop_refuses_what_it_cannot_find():
    text, _ = _listing(["FFMA", "QGMMA"], seed=3)
    with pytest.raises(ValueError, match=r"around='HMMA': 0 such instructions, nth=0"):
        innermost_loop(text, "HMMA")
    with pytest.raises(ValueError, match=r"around='QGMMA': 1 such instructions, nth=1"):
        innermost_loop(text, "QGMMA", nth=1)
    with pytest.raises(ValueError, match=r"around='S2R': instruction 0 is in no loop"):
        innermost_loop(text, "S2R")


def test_spill_loops_names_each_local_access_and_its_loop():
    """A spill store before the loops is in no loop (its nvdisasm note dropped); a reload in the inner loop's body
    is in the inner loop; one after the inner loop in the outer one; predicated accesses count, other opcodes
    (`LDS`, `STG`) do not."""
    from tools.sass_loop import spill_loops

    body = ["FFMA", "LDL R3, [R1+0x4]", "@P0 STL [R1+0x8], R2", "LDS R6, [R7]", "STG.E desc[UR4][R2.64], R5"]
    text, inner = _listing(body, seed=4)
    text = text.replace("S2R R0, SR_TID.X", 'STL [R1], R0                (*"SpillRefill"*)')  # nvdisasm's note
    text = text.replace("ISETP.NE.AND P3, PT, R1, R5, PT", "LDL.LU R9, [R1]")
    got = spill_loops(text)
    assert [t.split()[0] for t, _ in got] == ["STL", "LDL", "@P0", "LDL.LU"] and got[0][0] == "STL [R1], R0"
    assert [n for _, n in got] == [None, len(inner), len(inner), len(inner) + 3]
