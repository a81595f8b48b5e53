"""A launch plan bound to an arena: every argument of every launch as a concrete address or value.

The launch plan (compiler/launch_plan.py) is the runtime's only input; ``bind`` turns it into what a
launcher needs, given the arena's base address: the GPU runtime binds it to its device allocation,
the interpreter test (tests/test_launch_plan_interpreted.py) to offset 0 of a byte tensor. Plain
Python: no torch, no Triton, nothing from the compiler.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BoundLaunch:
    """One kernel launch: kernel table index, grid, the kernel's parameter types (Triton signature
    strings, ``*fp32``, ``i32``, ...) and the values to pass (pointers as addresses), and the global
    scratch pointer (0 when the kernel needs none)."""

    kernel_index: int
    grid: tuple[int, int, int]
    types: list[str]
    values: list
    scratch: int


@dataclass(frozen=True)
class Buffer:
    address: int
    dtype: str
    numel: int


@dataclass
class Binding:
    arena_bytes: int
    regions: dict[str, int]  # region -> address
    launches: list[BoundLaunch]  # the step, in order
    fill: list[BoundLaunch]  # made once at load for a random-weights plan
    weights: list[tuple[str, int, int]]  # (name, address, bytes) to upload for a checkpoint plan
    outputs: dict[str, Buffer]
    tokens: Buffer
    dyn: dict[str, Buffer]  # 4-byte slots
    reset: list[tuple[int, int]]  # (address, bytes) zeroed at the start of every request
    step_bytes: dict  # {"fixed", "kv_row_bytes"}: see bytes_per_step
    prefill_rows: int = 0  # the M-row step's rows (0: the plan has none)
    prefill_launches: list[BoundLaunch] | None = None  # the M-row step, in order
    prefill_outputs: dict[str, Buffer] | None = None  # its outputs (the chunk's last valid row)
    draft_tokens: int = 0  # speculative decoding's K (0: the plan has none)
    spec_prefill_launches: list[BoundLaunch] | None = None  # the speculative prefill, in order
    spec_launches: list[BoundLaunch] | None = None  # one speculative iteration, in order
    spec_outputs: dict[str, Buffer] | None = None  # the iteration's outputs (the verify's rows)
    spec_replay: Buffer | None = None  # the replayed token sequence (controlled acceptance)


def _bind_launch(lp: dict, launch: dict, regions: dict[str, int]) -> BoundLaunch:
    k = lp["kernels"][launch["kernel_index"]]
    values = [regions[a["region"]] + a["offset"] if "region" in a else a["const"] for a in launch["args"]]
    values += launch["scalars"]
    scratch = regions["scratch"] if k["global_scratch_size"] else 0
    return BoundLaunch(launch["kernel_index"], tuple(launch["grid"]), [t for _, t in k["params"]], values, scratch)


def bind(lp: dict, base: int) -> Binding:
    """Bind launch plan ``lp`` to an arena of ``lp["arena_bytes"]`` bytes at address ``base``."""
    regions = {name: base + r["offset"] for name, r in lp["regions"].items()}

    def buffer(p: dict) -> Buffer:
        return Buffer(regions[p["region"]] + p["offset"], p["dtype"], p["numel"])

    spec = lp.get("speculative")
    return Binding(
        arena_bytes=lp["arena_bytes"], regions=regions,
        launches=[_bind_launch(lp, launch, regions) for launch in lp["launches"]],
        fill=[_bind_launch(lp, launch, regions) for launch in lp["fill"]],
        weights=[(w["name"], regions["weights"] + w["offset"], w["nbytes"]) for w in lp["weights"]],
        outputs={name: buffer(p) for name, p in lp["outputs"].items()},
        tokens=buffer(lp["tokens"]),
        dyn={name: Buffer(regions["dyn"] + s["offset"], s["dtype"], 1) for name, s in lp["dyn_slots"].items()},
        reset=[(regions[r], lp["regions"][r]["size"]) for r in lp["reset"]],
        step_bytes=lp["step_bytes"],
        prefill_rows=lp["prefill"]["rows"] if lp.get("prefill") else 0,
        prefill_launches=[_bind_launch(lp, launch, regions) for launch in lp["prefill"]["launches"]]
        if lp.get("prefill") else None,
        prefill_outputs={name: buffer(p) for name, p in lp["prefill"]["outputs"].items()}
        if lp.get("prefill") else None,
        draft_tokens=spec["draft_tokens"] if spec else 0,
        spec_prefill_launches=[_bind_launch(lp, launch, regions) for launch in spec["prefill"]["launches"]]
        if spec else None,
        spec_launches=[_bind_launch(lp, launch, regions) for launch in spec["iteration"]["launches"]]
        if spec else None,
        spec_outputs={name: buffer(p) for name, p in spec["iteration"]["outputs"].items()} if spec else None,
        spec_replay=buffer(spec["replay"]) if spec and spec.get("replay") else None)


def bytes_per_step(step_bytes: dict, mean_len: float) -> int:
    """Bytes a decode step moves when its attention reads ``mean_len`` KV rows (compiler/launch_plan.py)."""
    return step_bytes["fixed"] + sum(int(row * mean_len) for row in step_bytes["kv_row_bytes"])
