"""plan_memory: place every buffer in one arena.

Invariant established: every weight, state, dyn slot and activation has a placement (region, byte
offset); every allocated buffer starts on a 256-byte boundary; two activations share bytes only if
their lifetimes do not overlap (an op's results never share bytes with its operands); views
(reshape, leading slices) alias their base and keep it alive.

Regions, in arena order: ``weights`` (read-only, uploaded once), ``state`` (conv windows, fp32
recurrent states, KV caches for max_seq rows — kept separate so a multi-sequence runtime can give
each sequence its own copy), ``dyn`` (the 4-byte per-token slots), ``act`` (activations, shared by
liveness: first fit over the free gaps).
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import ALIGN, DTYPE_BYTES, IRError, Program, Value
from kestrel.compiler.ops import is_view

REGIONS = ("weights", "state", "dyn", "act")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _place_sequential(items, region: str) -> int:
    off = 0
    for it in items:
        it.loc = (region, off)
        off += _align(it.type.nbytes)
    return off


class _FirstFit:
    def __init__(self):
        self.live: list[tuple[int, int]] = []  # (offset, size), sorted
        self.high = 0

    def alloc(self, size: int) -> int:
        size, off = _align(size), 0
        for lo, n in self.live:
            if lo - off >= size:
                break
            off = max(off, lo + n)
        self.live.append((off, size))
        self.live.sort()
        self.high = max(self.high, off + size)
        return off

    def free(self, off: int) -> None:
        self.live = [(lo, n) for lo, n in self.live if lo != off]


def plan_memory(program: Program) -> Program:
    p = copy.deepcopy(program)
    sizes = {"weights": _place_sequential(p.weights.values(), "weights"),
             "state": _place_sequential(p.states.values(), "state")}
    device_slots = [d for d in p.dyn.values() if not d.host]
    for i, d in enumerate(device_slots):
        d.loc = ("dyn", 4 * i)
    sizes["dyn"] = _align(4 * len(device_slots)) if device_slots else 0

    # liveness: a value's base (the buffer it aliases) lives until the last use of it or any view of it
    base: dict[int, Value] = {}
    last_use: dict[int, int] = {}
    end = len(p.ops)
    for i, op in enumerate(p.ops):
        for x in op.ins:
            if isinstance(x, Value):
                last_use[id(base.get(id(x), x))] = i
        if is_view(op):
            src = op.ins[0]
            base[id(op.outs[0])] = base.get(id(src), src)
    for v in p.outputs.values():
        last_use[id(base.get(id(v), v))] = end

    heap = _FirstFit()
    for i, op in enumerate(p.ops):
        if is_view(op):
            src, out = op.ins[0], op.outs[0]
            offset = src.loc[1]
            if op.kind == "slice":
                inner = 1
                for d in src.type.shape[op.attrs["axis"] + 1:]:
                    inner *= d
                offset += op.attrs["start"] * inner * DTYPE_BYTES[src.type.dtype]
            out.loc = ("act", offset)
            continue
        for o in op.outs:
            if isinstance(o, Value):
                o.loc = ("act", heap.alloc(o.type.nbytes))
        # free what dies here (after the results are placed, so they never overlap the operands)
        for x in {id(base.get(id(x), x)): base.get(id(x), x) for x in op.ins + op.outs
                  if isinstance(x, Value)}.values():
            if last_use.get(id(x), -1) <= i and x.loc is not None:
                heap.free(x.loc[1])
    sizes["act"] = heap.high
    p.arena = {r: sizes[r] for r in REGIONS}
    return p


def memory_report(program: Program) -> str:
    """Bytes per arena region, and what liveness sharing saved on activations."""
    unshared = sum(_align(o.type.nbytes) for op in program.ops if not is_view(op)
                   for o in op.outs if isinstance(o, Value))
    a = program.arena
    total = sum(a.values())
    lines = [f"memory: arena {total / 1e6:.2f} MB = weights {a['weights'] / 1e6:.2f} MB + state "
             f"{a['state'] / 1e6:.2f} MB + dyn {a['dyn']} B + activations {a['act'] / 1e3:.1f} kB "
             f"(liveness sharing: {unshared / 1e3:.1f} kB -> {a['act'] / 1e3:.1f} kB)"]
    return "\n".join(lines)


def check(program: Program) -> None:
    """After plan_memory: everything placed inside its region, allocated buffers aligned, and no two
    activations that are live at the same time share a byte (views alias their base)."""
    for group in (program.weights.values(), program.states.values()):
        for x in group:
            region = x.loc[0] if x.loc else None
            if x.loc is None or x.loc[1] % ALIGN or x.loc[1] + x.type.nbytes > program.arena.get(region, -1):
                raise IRError(f"{x.name}: placement {x.loc} is missing, unaligned or outside its region")
    base: dict[int, Value] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        for x in op.ins:
            if isinstance(x, Value):
                last[id(base.get(id(x), x))] = i
        if is_view(op):
            base[id(op.outs[0])] = base.get(id(op.ins[0]), op.ins[0])
            continue
        for o in op.outs:
            if isinstance(o, Value):
                if o.loc is None or o.loc[0] != "act" or o.loc[1] % ALIGN or \
                        o.loc[1] + o.type.nbytes > program.arena["act"]:
                    raise IRError(f"op #{i} ({op.kind}): result placement {o.loc} is missing, unaligned or outside act")
                first[id(o)], last[id(o)] = i, max(last.get(id(o), i), i)
    for v in program.outputs.values():
        last[id(base.get(id(v), v))] = len(program.ops)
    bufs = sorted((first[k], last[k], k) for k in first)
    values = {id(o): o for op in program.ops for o in op.outs if isinstance(o, Value)}
    for i, (f1, l1, k1) in enumerate(bufs):
        a = values[k1]
        for f2, l2, k2 in bufs[i + 1:]:
            if f2 > l1:
                break
            b = values[k2]
            if a.loc[1] < b.loc[1] + b.type.nbytes and b.loc[1] < a.loc[1] + a.type.nbytes:
                raise IRError(f"activations live at ops {f1}..{l1} and {f2}..{l2} overlap in the arena "
                              f"({a.loc} and {b.loc})")
