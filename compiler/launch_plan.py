"""The launch plan: everything a runtime needs to run a step program, and the runtime's only input.

``launch_list`` is the ordered list of launches: every op that moves data is one launch (views —
reshape, leading slices — are none). Its arguments are its operands then its results, each as an
arena placement ``{"region", "offset"}`` once plan_memory has run (a symbolic ``{"buffer": name}``
before), a host dyn slot as its value at the given token state ``{"const": v}``, and its attributes
as constants. The dyn-invariance check compares two of these lists.

``launch_plan`` is what the artifact stores (JSON), on top of the launches:
  * ``regions``: the arena layout: each region's byte offset and size (``REGIONS`` order, every
    region ``ALIGN``-aligned), ``arena_bytes`` in all, and ``reset``: the regions a request zeroes;
  * ``kernels``: the compiled-kernel table (compiler/codegen.py), each launch's ``kernel_index``;
  * ``dyn_slots``: name -> dtype and offset in the dyn region;
  * ``weights``: the uploads, each weight's placement in the weights region; or, for a plan that
    stores no weights (``--weights random``), none and ``fill``: the launches that make them on the
    device, made once at load;
  * ``outputs`` (hidden, logits) and ``tokens`` (the request's token sequence): placements, dtype, size;
  * ``step_bytes``: the bytes one step moves, as a fixed part and the bytes per KV-cache row read;
  * ``probes``: measuring kernels in the table that no step launches (the read-only bandwidth stream);
  * ``prefill`` (plans with an M-row step): its row count, its launches (same kernel table, same
    arena and dyn slots) and its outputs' placements;
  * ``speculative`` (plans built with ``--speculative mtp``): K, the speculative prefill's and the
    iteration's launches and outputs, and ``replay``, the placement of the replayed token sequence
    that controlled acceptance uploads (``--draft-source replay:FILE``).
runtime/launch_binding.py turns it into device addresses; the runtime reads nothing else.
"""
from __future__ import annotations

import math

import re

from kestrel.compiler.ir import ALIGN, SCRATCH_PREFIX, TOKENS_STATE, Dyn, Program, State, Value, Weight
from kestrel.compiler.ops import is_view, scalar_attrs

REPLAY_STATE = "spec.replay"  # the replayed token sequence of controlled acceptance (compiler/qwen3_5.py)
SPEC_ROW_STATES = (".conv_snap", ".recurrent_rows")  # the verify's per-row states of a Gated DeltaNet layer
REGIONS = ("weights", "state", "dyn", "act", "scratch")  # arena order
RESET_REGIONS = ("state", "dyn")  # zeroed at the start of every request
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


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
    out, counted = [], {}
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
            "constexprs": {k: v for k, v in launch.items() if k not in ("kernel", "grid", "num_warps", "fp_fusion")},
            "args": [_arg(x, names, state) for x in list(op.ins) + list(op.outs)],
            "scalars": scalar_attrs(op),  # the kernel's scalar parameters, in ABI order
            "attrs": dict(op.attrs),  # the same by name and its options (yarn), for reading (JSON has no order)
            "layer": _layer_of(op),
            "bytes": _launch_bytes(op, counted),
        })
    return out


def _layer_of(op) -> int | None:
    """The decoder layer a launch belongs to (from its weights' and states' names), None outside the
    layers (embedding, final norm, lm_head, sampling; the gather with the first layer's norm folded in,
    ``embedding_rmsnorm``, stays the embedding's)."""
    if op.kind == "embedding_rmsnorm":
        return None
    for x in op.ins:
        if isinstance(x, (Weight, State)):
            m = _LAYER.search(x.name)
            if m:
                return int(m.group(1))
    return None


# the MoE expert kernels: (the operand whose leading dimensions count the (row, expert) pairs a launch routes:
# its ids [k] / [M, k], or the grouped kernels' sorted pairs [P, ..], how many of them, the operands that are
# stacked per-expert matrices [E * rows, cols], kernels/moe.py)
STACKED_EXPERTS = {"moe_gate_up": (1, 2, (2, 3)), "moe_down": (1, 2, (3,)), "rmsnorm_moe_gate_up": (3, 2, (4, 5)),
                   "moe_down_add": (1, 2, (3,)), "moe_gate_up_grouped": (1, 1, (3, 4)), "moe_down_grouped": (0, 1, (2,))}


def _launch_bytes(op, counted: dict) -> dict:
    """Bytes launch ``op`` moves that no earlier launch of the step was charged for: ``{"fixed",
    "kv_row_bytes"}``. ``counted`` maps each weight / state (by id) to the bytes already charged and is
    updated. An embedding gather reads one row of its table; any other op reads a weight whole, so an
    embedding table that is also the lm_head (tied) is charged in full at the lm_head (the row the
    gather read is then part of that). States are read and written (twice their size), the token
    sequence one row each way, a KV cache its rows 0..pos (the per-row bytes); a MoE layer's stacked
    experts the slices of the experts a token routes to (top_k of E; at M rows at most M top_k of them,
    an upper bound when rows share experts); ``scratch.*`` states
    (a kernel's partials within one launch, L2-resident) none; the speculative verify's conv snapshots and rows'
    updates once (written; gdn_commit's reads of them are not counted)."""
    fixed, rows = 0, []
    for i, x in enumerate(op.ins):
        if not isinstance(x, (Weight, State)) or x.name.startswith(SCRATCH_PREFIX):  # scratch: a kernel's own
            continue
        if isinstance(x, State) and x.name.endswith(("k_cache", "v_cache")):
            if id(x) not in counted:
                counted[id(x)] = 0
                rows.append(x.type.nbytes // x.type.shape[0])
            continue
        if op.kind in ("embedding", "embedding_rmsnorm", "embedding_rows", "embedding_next_rows") and i == 0:
            want = x.type.nbytes // x.type.shape[0] * op.attrs.get("rows", 1)
        elif i in STACKED_EXPERTS.get(op.kind, (0, 0, ()))[2]:  # the routed experts' slices only: top_k of E a row
            at, dims, _ = STACKED_EXPERTS[op.kind]
            pairs = math.prod(op.ins[at].type.shape[:dims])
            # moe_down: the stacked down is [E * H, I], the shared down (operand 4) [H, S]
            experts = op.attrs["experts"] if "experts" in op.attrs else x.type.shape[0] // op.ins[4].type.shape[0]
            want = x.type.nbytes // experts * min(experts, pairs)
        elif isinstance(x, State) and x.name == TOKENS_STATE:
            want = 8
        elif isinstance(x, State) and x.name.endswith(SPEC_ROW_STATES):  # the verify's: written once
            want = x.type.nbytes
        elif isinstance(x, State):
            want = 2 * x.type.nbytes
        else:
            want = x.type.nbytes
        have = counted.get(id(x), 0)
        if want > have:
            fixed += want - have
            counted[id(x)] = want
    return {"fixed": fixed, "kv_row_bytes": rows}


def step_bytes(program: Program) -> dict:
    """Bytes one decode step must move, as ``fixed + sum(row * rows read)`` over ``kv_row_bytes``:
    every weight a kernel reads (one row of an embedding table; the whole table when it is also the
    tied lm_head), recurrent and conv states read and written, one row of the token sequence read and
    written, and per KV cache its rows 0..pos. Activations are not counted (they stay in L2 at batch 1:
    the largest, the logits, is 1 MB at a 248k vocabulary). The sum of ``_launch_bytes`` over the launches."""
    fixed, rows, counted = 0, [], {}
    for op in program.ops:
        if not is_view(op):
            b = _launch_bytes(op, counted)
            fixed += b["fixed"]
            rows += b["kv_row_bytes"]
    return {"fixed": fixed, "kv_row_bytes": rows}


def _placement(v) -> dict:
    return {"region": v.loc[0], "offset": v.loc[1], "dtype": v.type.dtype, "numel": v.type.numel}


def launch_plan(program: Program, kernels: list[dict] | None = None, kernel_of_launch: list[int] | None = None,
                fill: list[dict] | None = None, prefill: tuple[Program, list[int]] | None = None,
                probes: dict | None = None, speculative: tuple | None = None) -> dict:
    """The launch plan stored in the artifact (requires select_kernels and plan_memory). ``kernels`` is
    the compiled-kernel table (GPU targets) and ``kernel_of_launch`` each launch's entry in it; the
    ``scratch`` region is sized for the largest global scratch any launch needs. ``prefill``: the M-row
    step (its program, planned in the same arena, and its launches' kernel entries), stored as
    ``prefill`` = {rows, launches, outputs}."""
    launches = launch_list(program)
    sizes = dict(program.arena)
    sizes["scratch"] = 0
    lists = [(launches, kernel_of_launch)]
    rows_launches = None
    if prefill is not None:
        rows_launches = launch_list(prefill[0])
        lists.append((rows_launches, prefill[1]))
    spec_lists = None
    if speculative is not None:
        spec_lists = (launch_list(speculative[0]), launch_list(speculative[2]))
        lists += [(spec_lists[0], speculative[1]), (spec_lists[1], speculative[3])]
    if kernels is not None:
        for ls, of_launch in lists:
            for launch, k in zip(ls, of_launch):
                launch["kernel_index"] = k
                programs = launch["grid"][0] * launch["grid"][1] * launch["grid"][2]
                sizes["scratch"] = max(sizes["scratch"], kernels[k]["global_scratch_size"] * programs)
    regions, offset = {}, 0
    for r in REGIONS:
        size = (sizes.get(r, 0) + ALIGN - 1) // ALIGN * ALIGN
        regions[r] = {"offset": offset, "size": size}
        offset += size
    tokens = program.states.get(TOKENS_STATE)
    lp = {"target": program.target, "arena": sizes, "regions": regions, "arena_bytes": max(offset, ALIGN),
          "reset": list(RESET_REGIONS), "kernels": kernels or [],
          "dyn_slots": {d.name: {"dtype": d.dtype, "offset": d.loc[1]} for d in program.dyn.values()},
          "weights": [] if fill else [{"name": w.name, "offset": w.loc[1], "nbytes": w.type.nbytes}
                                      for w in _all_weights(program, speculative)],
          "fill": fill or [],
          "outputs": {name: _placement(v) for name, v in program.outputs.items()},
          "tokens": _placement(tokens) if tokens is not None else None,
          "step_bytes": step_bytes(program),
          "probes": probes or {},
          "launches": launches}
    if prefill is not None:
        for d in prefill[0].dyn.values():  # its own slots (dyn.last) beside the shared ones
            lp["dyn_slots"].setdefault(d.name, {"dtype": d.dtype, "offset": d.loc[1]})
        rows = next(op.attrs["rows"] for op in prefill[0].ops if op.kind == "prefill_end")
        lp["prefill"] = {"rows": rows, "launches": rows_launches,
                         "outputs": {name: _placement(v) for name, v in prefill[0].outputs.items()}}
    if speculative is not None:
        sp, it = speculative[0], speculative[2]
        for p in (sp, it):
            for d in p.dyn.values():
                lp["dyn_slots"].setdefault(d.name, {"dtype": d.dtype, "offset": d.loc[1]})
        lp["speculative"] = {
            "method": "mtp", "draft_tokens": speculative[4],
            "prefill": {"rows": next(op.attrs["rows"] for op in sp.ops if op.kind == "prefill_end"),
                        "launches": spec_lists[0], "outputs": {n: _placement(v) for n, v in sp.outputs.items()}},
            "iteration": {"launches": spec_lists[1], "outputs": {n: _placement(v) for n, v in it.outputs.items()}},
            "replay": _placement(it.states[REPLAY_STATE]) if REPLAY_STATE in it.states else None}
    return lp


def _all_weights(program: Program, speculative: tuple | None) -> list:
    """The step's weights, then those only the speculative programs read (the MTP head's)."""
    out = list(program.weights.values())
    if speculative is not None:
        seen = set(program.weights)
        extra = {n: w for p in (speculative[0], speculative[2]) for n, w in p.weights.items() if n not in seen}
        out += sorted(extra.values(), key=lambda w: w.loc[1])
    return out
