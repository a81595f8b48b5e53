"""The launch list of a step program: what a runtime launches, in order, with concrete arguments.

Every op that moves data is one launch (views — reshape, leading slices — are none). Its arguments
are its operands then its results, each as an arena placement ``{"region", "offset"}`` once
plan_memory has run (a symbolic ``{"buffer": name}`` before), a host dyn slot as its value at the
given token state ``{"const": v}``, and its attributes as constants. ``launch_list`` is what the
dyn-invariance check compares; ``launch_plan`` is what the artifact stores.
"""
from __future__ import annotations

from kestrel.compiler.ir import Dyn, Program, State, Value, Weight, is_view


def _arg(x, names: dict, state: dict | None):
    if isinstance(x, Dyn) and x.host:
        if state is None:
            raise ValueError(f"dyn slot {x.name!r} is still a host argument")
        return {"const": state[x.name]}
    if x.loc is not None:
        return {"region": x.loc[0], "offset": x.loc[1]}
    if isinstance(x, Value):
        return {"buffer": names.setdefault(id(x), f"%{len(names)}")}
    kind = {Weight: "weight", State: "state", Dyn: "dyn"}[type(x)]
    return {"buffer": f"{kind}.{x.name}"}


def launch_list(program: Program, state: dict | None = None) -> list[dict]:
    names: dict[int, str] = {}
    out = []
    for op in program.ops:
        for o in op.outs:  # name results in definition order, views included
            if isinstance(o, Value):
                names.setdefault(id(o), f"%{len(names)}")
        if is_view(op):
            continue
        launch = op.launch or {}
        out.append({
            "op": op.kind,
            "kernel": launch.get("kernel"),
            "grid": launch.get("grid"),
            "num_warps": launch.get("num_warps"),
            "constexprs": {k: v for k, v in launch.items() if k not in ("kernel", "grid", "num_warps")},
            "args": [_arg(x, names, state) for x in list(op.ins) + list(op.outs)],
            "scalars": list(op.attrs.values()),  # the kernel's scalar parameters, in ABI order
            "attrs": dict(op.attrs),  # the same by name, for reading (JSON objects carry no order)
        })
    return out


def launch_plan(program: Program, kernels: list[dict] | None = None,
                kernel_of_launch: list[int] | None = None) -> dict:
    """The launch plan stored in the artifact (requires plan_memory and select_kernels). ``kernels``
    is the compiled-kernel table (GPU targets) and ``kernel_of_launch`` each launch's entry in it;
    the arena gains a ``scratch`` region sized for the largest global scratch any launch needs."""
    launches = launch_list(program)
    arena = dict(program.arena)
    if kernels is not None:
        scratch = 0
        for launch, k in zip(launches, kernel_of_launch):
            launch["kernel_index"] = k
            programs = launch["grid"][0] * launch["grid"][1] * launch["grid"][2]
            scratch = max(scratch, kernels[k]["global_scratch_size"] * programs)
        arena["scratch"] = scratch
    return {"target": program.target, "arena": arena, "kernels": kernels or [],
            "dyn_slots": {d.name: {"dtype": d.dtype, "offset": d.loc[1]} for d in program.dyn.values()},
            "launches": launches}
