"""Where a compiled XLA program's memory traffic goes: bytes per top-level operation of its
optimized HLO, loops counted by their known trip counts.

A fusion reads its operands and writes its result once (what a fused kernel does), except that an
operand read only through a slice, dynamic slice or gather inside the fusion counts the sliced
bytes, and an in-place update (dynamic-update-slice, scatter) counts what it writes, not the
buffer it writes into. This is the model XLA's own cost analysis follows; the table says which
operation moves the bytes."""

from __future__ import annotations

import dataclasses
import math
import re

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\b(?:calls|body|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DIMS = re.compile(r"(lhs_contracting_dims|lhs_batch_dims)=\{([0-9,]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# operations that move no bytes of their own
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "opt-barrier",
    "copy-start",
    "copy-done",
}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string (a tuple's elements added up)."""
    return sum(
        _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    line: str
    root: bool


@dataclasses.dataclass
class Operation:
    """One top-level operation's traffic: its bytes and FLOPs per program run (loops counted)."""

    name: str
    opcode: str
    kind: str  # what it computes: the fused computation's main op (dot, reduce, ...) or opcode
    op_name: str  # the JAX source op it came from (metadata)
    bytes: int
    flops: int  # of its matrix products (2 per multiply-add)
    count: int  # runs per program run (the product of its loops' trip counts)


def parse(hlo: str) -> dict[str, dict[str, Instruction]]:
    """Computation name -> its instructions by name, in order; the entry as "ENTRY"."""
    computations: dict[str, dict[str, Instruction]] = {}
    current: dict[str, Instruction] | None = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = {}
            computations["ENTRY" if header.group(1) else header.group(2)] = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            root, name, shape, opcode, rest = m.groups()
            args = rest.split("), ", 1)[0] if ")" in rest else rest
            current[name] = Instruction(
                name, shape, opcode, _OPERAND.findall(args), line, bool(root)
            )
    return computations


def _fused_main(comp: dict[str, Instruction]) -> str:
    """The kind of a fused computation: its dot, convolution, reduce, scatter, ... else loop."""
    ops = {i.opcode for i in comp.values()}
    for kind in (
        "dot",
        "convolution",
        "scatter",
        "dynamic-update-slice",
        "gather",
        "sort",
        "reduce",
        "reduce-window",
        "dynamic-slice",
        "transpose",
        "concatenate",
    ):
        if kind in ops:
            return kind
    return "elementwise"


def _dot_flops(inst: Instruction, shapes: dict[str, str]) -> int:
    """2 x the multiply-adds of a dot: its output's elements times its contracted size."""
    lhs = _ARRAY.search(shapes.get(inst.operands[0], "")) if inst.operands else None
    out = _ARRAY.search(inst.shape)
    if lhs is None or out is None:
        return 0
    dims = [int(d) for d in lhs.group(2).split(",") if d]
    contracting = dict(_DIMS.findall(inst.line)).get("lhs_contracting_dims", "")
    k = math.prod(dims[int(i)] for i in contracting.split(",") if i)
    return 2 * k * math.prod(int(d) for d in out.group(2).split(",") if d)


def _computation_flops(comp: dict[str, Instruction]) -> int:
    shapes = {i.name: i.shape for i in comp.values()}
    return sum(_dot_flops(i, shapes) for i in comp.values() if i.opcode == "dot")


def _update_operand(inst: Instruction) -> str:
    """The operand an in-place update writes: a scatter's updates, a dynamic-update-slice's."""
    return inst.operands[2] if inst.opcode == "scatter" else inst.operands[1]


def _fusion_bytes(inst: Instruction, shapes: dict[str, str], fused: dict[str, Instruction]) -> int:
    """A fusion's bytes: each operand read once (or only its sliced part), the result written
    once (or only the update, for an in-place root)."""
    params = {
        int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name
        for i in fused.values()
        if i.opcode == "parameter"
    }
    users: dict[str, list[Instruction]] = {}
    for i in fused.values():
        for o in i.operands:
            users.setdefault(o, []).append(i)
    root = next(i for i in fused.values() if i.root)
    in_place = {root.operands[0]} if root.opcode in _IN_PLACE and root.operands else set()
    total = 0
    for index, operand in enumerate(inst.operands):
        param = params.get(index)
        uses = users.get(param, []) if param else []
        if param in in_place:
            continue  # the buffer updated in place: only the update moves
        if uses and all(u.opcode in _SLICING and u.operands[0] == param for u in uses):
            total += sum(shape_bytes(u.shape) for u in uses)
        else:
            total += shape_bytes(shapes.get(operand, ""))
    if in_place:
        update = _update_operand(root)
        return total + shape_bytes(fused[update].shape) if update in fused else total
    return total + shape_bytes(inst.shape)


def operations(hlo: str) -> list[Operation]:
    """Every top-level operation of the entry and of the loops and calls it runs, with its bytes
    per run of the program."""
    computations = parse(hlo)
    out: list[Operation] = []

    def walk(name: str, count: int) -> None:
        comp = computations[name]
        shapes = {i.name: i.shape for i in comp.values()}
        for inst in comp.values():
            if inst.opcode in _FREE:
                continue
            called = _CALLS.findall(inst.line)
            if inst.opcode == "while":
                trip = _TRIP.search(inst.line)
                body = re.search(r"body=%([\w.\-]+)", inst.line).group(1)
                walk(body, count * (int(trip.group(1)) if trip else 1))
                continue
            if inst.opcode in ("call", "conditional", "async-start"):
                branches = _BRANCHES.search(inst.line)
                names = _OPERAND.findall(branches.group(1)) if branches else called
                for sub in names[:1]:  # a conditional: its first branch
                    walk(sub, count)
                continue
            fused = computations.get(called[0]) if inst.opcode == "fusion" and called else None
            flops = 0
            if fused is not None:
                nbytes, kind = _fusion_bytes(inst, shapes, fused), _fused_main(fused)
                flops = _computation_flops(fused)
            elif inst.opcode in _IN_PLACE:
                nbytes = 2 * shape_bytes(shapes.get(_update_operand(inst), ""))
                kind = inst.opcode
            else:
                operand_bytes = sum(shape_bytes(shapes.get(o, "")) for o in inst.operands)
                nbytes, kind = operand_bytes + shape_bytes(inst.shape), inst.opcode
                flops = _dot_flops(inst, shapes) if inst.opcode == "dot" else 0
            op = _OP_NAME.search(inst.line)
            out.append(
                Operation(
                    inst.name,
                    inst.opcode,
                    kind,
                    op.group(1) if op else "",
                    nbytes * count,
                    flops * count,
                    count,
                )
            )

    walk("ENTRY", 1)
    return out


def table(ops: list[Operation], top: int = 12) -> list[dict]:
    """The ``top`` operations by bytes, as rows (name, kind, source op, GB, share, runs)."""
    total = sum(o.bytes for o in ops) or 1
    rows = sorted(ops, key=lambda o: -o.bytes)[:top]
    return [
        {
            "name": o.name,
            "kind": o.kind,
            "op_name": o.op_name,
            "bytes": o.bytes,
            "share": o.bytes / total,
            "runs": o.count,
        }
        for o in rows
    ]
