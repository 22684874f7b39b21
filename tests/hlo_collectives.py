"""Reading collectives out of compiled HLO text: which ones run inside the generation loop's body.

``loop_collectives(hlo_text)`` finds the outermost ``while`` of ``jit(generate)`` (op_name ``jit(generate)/while``),
walks every computation its body reaches (nested loops, conds, fusions, reductions) and lists each collective
instruction there as (kind, result shape, op_name): the op_name (from the HLO metadata) names the jax operation the
partitioner added the collective for, e.g. ``.../layers_0/self_attn/o_proj/dot_general``.
"""

from __future__ import annotations

import re
from typing import Iterator

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP = re.compile(r"=\s*([\w\[\]{},\s/*=.:\-()]+?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    comps, name = {}, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            name = header.group(1)
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line.strip())
    return comps


def callees(line: str) -> Iterator[str]:
    yield from _CALLEE.findall(line)
    for group in _BRANCHES.findall(line):
        yield from (name.strip().lstrip("%") for name in group.split(","))


def generate_loop_body(comps: dict[str, list[str]]) -> str:
    """The body computation of the outermost generation loop."""
    for lines in comps.values():
        for line in lines:
            if " while(" in line and 'op_name="jit(generate)/while"' in line:
                return re.search(r"body=%?([\w.\-]+)", line).group(1)
    raise AssertionError("no jit(generate)/while loop in the HLO")


def generate_loop_count(hlo_text: str) -> int:
    """How many ``while`` instructions are the program's own generation loop (op_name ``jit(generate)/while``)."""
    return sum(" while(" in line and 'op_name="jit(generate)/while"' in line for line in hlo_text.splitlines())


def reachable(comps: dict[str, list[str]], root: str) -> list[str]:
    seen, stack = [], [root]
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.append(name)
        for line in comps[name]:
            stack.extend(callees(line))
    return seen


def loop_collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(kind, result shape, op_name) of every collective inside the generation loop's body."""
    comps = computations(hlo_text)
    found = []
    for name in reachable(comps, generate_loop_body(comps)):
        for line in comps[name]:
            op = _OP.search(line)
            if op:
                shape = _SHAPE.search(op.group(1))
                dims = tuple(int(d) for d in shape.group(1).split(",") if d) if shape else ()
                op_name = _OP_NAME.search(line)
                found.append((op.group(2), dims, op_name.group(1) if op_name else ""))
    return found
