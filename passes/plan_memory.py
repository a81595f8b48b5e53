"""plan_memory: place every buffer in one arena.

Invariant established: every weight, state, dyn slot and activation has a placement (region, byte
offset); every allocated buffer starts on a 256-byte boundary; two activations share bytes only if
their lifetimes do not overlap (an op's results never share bytes with its operands); views
(reshape, leading slices) alias their base and keep it alive.

A plan's second program (the M-row step) is planned against the first (``base``): what they share
keeps one placement, so both programs read and write the same weights, states and dyn slots.

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


def _place_sequential(items, region: str, base: dict | None = None, start: int = 0) -> int:
    """Back to back from ``start``; an item ``base`` already places (by name, same type) keeps that
    placement. Returns the end of the region."""
    off = end = start
    for it in items:
        shared = (base or {}).get(it.name)
        if shared is not None:
            if shared.type != it.type:
                raise IRError(f"{it.name}: typed {it.type} here but {shared.type} in the program it shares the arena "
                              f"with")
            it.loc = shared.loc
            end = max(end, it.loc[1] + _align(it.type.nbytes))
            continue
        it.loc = (region, off)
        off += _align(it.type.nbytes)
        end = max(end, off)
    return end


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


def plan_memory(program: Program, base: Program | None = None) -> Program:
    """``base``: a planned program this one shares the arena with (a plan's M=1 step, for its M-row
    step): every weight, state and dyn slot of the same name keeps base's placement, anything new goes
    after base's, and activations are planned afresh (the two programs never run at once, so they share
    the act region)."""
    p = copy.deepcopy(program)
    b = base or Program()
    sizes = {"weights": _place_sequential(p.weights.values(), "weights", b.weights, b.arena.get("weights", 0)),
             "state": _place_sequential(p.states.values(), "state", b.states, b.arena.get("state", 0))}
    device_slots = [d for d in p.dyn.values() if not d.host]
    taken = {d.loc[1] for d in b.dyn.values() if d.loc is not None}
    free = (4 * i for i in range(4 * len(device_slots) + len(taken) + 1) if 4 * i not in taken)
    for d in device_slots:
        shared = b.dyn.get(d.name)
        d.loc = shared.loc if shared is not None and shared.loc is not None else ("dyn", next(free))
    sizes["dyn"] = max([b.arena.get("dyn", 0)] + [_align(d.loc[1] + 4) for d in device_slots]) if device_slots else 0

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


def memory_report(program: Program, rows_program: Program | None = None) -> str:
    """Bytes per arena region, and what liveness sharing saved on activations (of each program, when
    the plan also has an M-row step sharing the arena)."""
    a = program.arena
    total = sum(a.values())
    lines = [f"memory: arena {total / 1e6:.2f} MB = weights {a['weights'] / 1e6:.2f} MB + state "
             f"{a['state'] / 1e6:.2f} MB + dyn {a['dyn']} B + activations {a['act'] / 1e3:.1f} kB "
             f"(liveness sharing: {_unshared(program) / 1e3:.1f} kB -> {_act_used(program) / 1e3:.1f} kB)"]
    if rows_program is not None:
        lines.append(f"memory: the M-row step shares that arena: activations {_act_used(rows_program) / 1e3:.1f} kB "
                     f"(liveness sharing: {_unshared(rows_program) / 1e3:.1f} kB -> "
                     f"{_act_used(rows_program) / 1e3:.1f} kB)")
    return "\n".join(lines)


def _unshared(program: Program) -> int:
    return sum(_align(o.type.nbytes) for op in program.ops if not is_view(op) for o in op.outs if isinstance(o, Value))


def _act_used(program: Program) -> int:
    """The act bytes this program's activations reach (its region may be larger: shared with another)."""
    return max([_align(o.loc[1] + o.type.nbytes) for op in program.ops if not is_view(op) for o in op.outs
                if isinstance(o, Value)], default=0)


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
