"""Reading compiled HLO module text: its computations, and which run inside a while loop.

Used by `--compile_only` (the collectives a program holds), `seqpipe.tools.memory` (carry
copies per tick) and the tests (what the loop sends).
"""

import math
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")
# `%name = shape op(...)`: the op follows a space (the name after `%` never does). An async
# collective is one `-start` and one `-done`; the start counts it.
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# Each computation starts on a header line `[ENTRY ]%name (params) -> result {`.
_HEADER = re.compile(r"\n(?=(?:ENTRY )?%?[\w.\-]+ [^\n]*\{\n)")
_NAME = re.compile(r"(?:ENTRY )?%?([\w.\-]+) ")
_WHILE_BODY = re.compile(r"while\([^\n]*body=%?([\w.\-]+)")
# The attributes that name the computations an instruction calls: one name or a {list}.
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|true_computation|"
    r"false_computation)=\{?([^}\n]*?)\}?(?:,\s*\w+=|$|\n|\))"
)


def computations(hlo: str) -> dict[str, str]:
    """HLO module text split into {computation name: its text}."""
    out = {}
    for part in _HEADER.split(hlo):
        if m := _NAME.match(part):
            out[m.group(1)] = part
    return out


def called(text: str) -> set[str]:
    """Names of the computations that the instructions in `text` call."""
    names = set()
    for group in _CALLED.findall(text):
        names.update(n.strip().lstrip("%") for n in group.split(","))
    return names


def loop_bodies(comps: dict[str, str]) -> list[str]:
    """Names of the while loops' body computations."""
    return [body for text in comps.values() for body in _WHILE_BODY.findall(text)]


def inside_loops(comps: dict[str, str]) -> set[str]:
    """Names of the computations run inside a while loop: its bodies and all they call."""
    inside, todo = set(), loop_bodies(comps)
    while todo:
        name = todo.pop()
        if name in inside or name not in comps:
            continue
        inside.add(name)
        todo.extend(called(comps[name]))
    return inside


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective the program holds: instructions in the text, not
    executions (one in a loop body counts once)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _OP.finditer(hlo_text):
        counts[match[1]] += 1
    return counts


# `replica_groups={{0,1},{2,3}}`, the iota form `replica_groups=[4,2]<=[2,4]T(1,0)`, or
# (jax 0.12's XLA) a named mesh and the axes a group spans,
# `replica_groups=mesh['data'=2,'tensor'=2] {'tensor'}`.
_GROUPS = re.compile(
    r"replica_groups=(\{\{[\d,{}\s]*\}\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
    r"|mesh\[[^\]]*\]\s*\{[^}]*\})"
)


def _parse_groups(text: str) -> frozenset[frozenset[int]]:
    if text.startswith("mesh"):
        return _mesh_groups(text)
    if text.startswith("{"):
        return frozenset(
            frozenset(int(d) for d in g.split(",") if d.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])
        )
    shape, dims, *perm = re.findall(r"[\[(]([\d,]+)[\])]", text)
    ids = np.arange(math.prod(int(d) for d in dims.split(",")))
    ids = ids.reshape([int(d) for d in dims.split(",")])
    if perm:
        ids = ids.transpose([int(d) for d in perm[0].split(",")])
    ids = ids.reshape([int(d) for d in shape.split(",")])
    return frozenset(frozenset(int(d) for d in row) for row in ids)


def _mesh_groups(text: str) -> frozenset[frozenset[int]]:
    """A named mesh's groups: device ids in the mesh's row-major order, one group per
    place on the axes the group does not span."""
    axes = re.findall(r"'(\w+)'=(\d+)", text)
    spanned = set(re.findall(r"'(\w+)'", text[text.index("{") :]))
    ids = np.arange(math.prod(int(n) for _, n in axes)).reshape([int(n) for _, n in axes])
    inner = [i for i, (name, _) in enumerate(axes) if name in spanned]
    outer = [i for i in range(len(axes)) if i not in inner]
    rows = ids.transpose(outer + inner).reshape(-1, math.prod(ids.shape[i] for i in inner))
    return frozenset(frozenset(int(d) for d in row) for row in rows)


def collective_groups(hlo_text: str) -> list[tuple[str, frozenset[frozenset[int]]]]:
    """(op, its device groups) of each collective with replica groups in the text (the
    collective permutes, which have source-target pairs instead, are left out)."""
    out = []
    for line in hlo_text.splitlines():
        op = _OP.search(line)
        groups = _GROUPS.search(line)
        if op and groups:
            out.append((op[1], _parse_groups(groups[1])))
    return out
