"""hoist_dynamic: move every per-token value into the device dyn buffer.

Invariant established: no kernel argument changes from one token to the next. Position, KV write
index, attention length (pos + 1, derived in the kernels from dyn.pos), input token, sampled token
and sampling settings are dyn slots in device memory, read by the kernels; the step ends with
``step_end``, which appends the sampled token to the request's token sequence (the ``tokens``
state) once past the prompt, feeds the next token in from it (the next prompt id during prefill)
and advances pos. So a request needs one host write (prompt ids and settings) before its first
step and none per token.

``check_dyn_invariance`` proves it on a program: it materialises the launch list at two different
token states and requires them identical. Every build runs it on the final program.

**Routing buffers** (Qwen3-Next's MoE, kernels/moe.py): which experts run changes every token, and it
must reach the expert kernels only as data in device memory. ``check_routing`` (part of
``check_dyn_invariance``) proves, for every program with a router: every routing buffer (a
``moe_router`` result, ``moe_topk``'s once fuse split the router) is an arena buffer read only by the ops that index stacked experts with it on
the device (``ROUTING_READERS``, at their routing operands); every expert weight is a layer's stacked
matrix (no single expert's weight anywhere in the program), read only by those ops; and each such
op's launch is exactly what its launch rule gives from the op's shapes (no constant from anywhere
else, such as an expert id, in its grid, constexprs or scalars). With the two-token-state comparison
this makes the launch list the same for every token whichever experts the router picks.
"""
from __future__ import annotations

import copy

import re

from kestrel.compiler.ir import TOKENS_STATE, IRError, Op, Program, Value, Weight
from kestrel.compiler.launch_plan import launch_list
from kestrel.compiler.ops import OPS, Kernel
from kestrel.kernels.targets import TARGETS


def hoist_dynamic(program: Program) -> Program:
    p = copy.deepcopy(program)
    for d in p.dyn.values():
        d.host = False
    has_end = any(op.kind in END_OPS for op in p.ops)
    if not has_end and "sampled" in p.dyn and any(op.kind == "sample" for op in p.ops):
        if TOKENS_STATE not in p.states or "n_prompt" not in p.dyn:
            raise IRError(f"the step has no token sequence to feed itself from (state {TOKENS_STATE} and dyn "
                          f"n_prompt, which the lowering declares)")
        d = p.dyn
        p.ops.append(Op("step_end", outs=[d["pos"], d["token"]],
                        ins=[d["pos"], d["sampled"], d["n_prompt"], p.states[TOKENS_STATE]]))
    return p


END_OPS = ("step_end", "prefill_end", "spec_end")  # the ops that advance pos (the M=1 step's, the M-row step's,
# the speculative iteration's)
STATES = ({"pos": 3, "token": 17, "sampled": 5, "temperature": 0.0, "top_p": 1.0, "seed": 1, "n_prompt": 2,
           "last": 3, "top_k": 0, "min_p": 0.0, "vend": 7, "npos": 5, "dpos": 4, "draft": 9, "accepted": 1,
           "draft_temperature": 0.0, "replay": 0, "replay_accept": 0.0},
          {"pos": 117, "token": 2, "sampled": 9, "temperature": 0.7, "top_p": 0.9, "seed": 4, "n_prompt": 200,
           "last": 180, "top_k": 20, "min_p": 0.05, "vend": 121, "npos": 118, "dpos": 119, "draft": 3,
           "accepted": 0, "draft_temperature": 0.0, "replay": 1, "replay_accept": 0.8})


def check_dyn_invariance(program: Program) -> int:
    """Raise IRError unless the launch list is identical at two token states and the step advances
    itself (step_end); returns the number of launches. Every build runs it on the final program."""
    n = _same_launches(program)
    check_routing(program)
    if not any(op.kind in END_OPS for op in program.ops):
        raise IRError("the step does not advance pos itself (no step_end): the host would write per token; "
                      "run hoist_dynamic")
    return n


ROUTING_READERS = {"moe_experts": (1, 2), "moe_gate_up": (1,), "moe_down": (1, 2), "rmsnorm_moe_gate_up": (3,),
                   "moe_down_add": (1, 2), "moe_group": (0,), "moe_gate_up_grouped": (1, 2), "moe_down_grouped": (1,),
                   "moe_combine": (1, 2)}  # op -> routing operands
_ONE_EXPERT = re.compile(r"\.experts\.\d+\.")


def check_routing(program: Program) -> int:
    """Raise IRError unless every routing buffer reaches the expert kernels only as device data (the
    module docstring); returns the number of routers."""
    routing = {id(o): op for op in program.ops if op.kind in ("moe_router", "moe_topk", "moe_group") for o in op.outs}
    single = [w.name for w in program.weights.values() if _ONE_EXPERT.search(w.name)]
    if single:
        raise IRError(f"routing: weight {single[0]!r} is one expert's: the experts of a layer must be one stacked "
                      f"matrix indexed on the device by the routing buffer")
    for i, op in enumerate(program.ops):
        where = f"routing: op #{i} ({op.kind})"
        reads = ROUTING_READERS.get(op.kind, ())
        for j, x in enumerate(op.ins):
            if isinstance(x, Value) and id(x) in routing and j not in reads:
                raise IRError(f"{where} reads a routing buffer as operand {j}; only the expert kernels may, as data")
            if isinstance(x, Weight) and ".experts." in x.name and op.kind not in ROUTING_READERS:
                raise IRError(f"{where} reads the stacked experts {x.name!r} without the routing buffer")
        if not reads:
            continue
        for j in reads:
            if id(op.ins[j]) not in routing:
                raise IRError(f"{where}: operand {j} is not a router's routing buffer")
            if program.target is not None and program.target != "cpu" and op.ins[j].loc is None and \
                    program.arena:
                raise IRError(f"{where}: routing buffer operand {j} is not placed in the arena")
        kernel = OPS[op.kind].kernel
        if program.target not in (None, "cpu") and isinstance(kernel, Kernel) and op.launch is not None:
            rule = kernel.launch(op, TARGETS[program.target])
            want = {k: v for k, v in rule.items() if k != "constexprs"} | rule.get("constexprs", {})
            if op.launch != want:
                extra = {k: v for k, v in op.launch.items() if want.get(k) != v}
                raise IRError(f"{where}: its launch carries {extra}, which its launch rule does not give from the "
                              f"op's shapes: a per-token value (an expert id?) baked into a kernel argument")
    return sum(op.kind != "moe_group" for op in {id(op): op for op in routing.values()}.values())


def _same_launches(program: Program) -> int:
    a, b = (launch_list(program, state) for state in STATES)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise IRError(f"launch #{i} ({x['op']}) changes from token to token: {x['args']} vs {y['args']}; "
                          f"run hoist_dynamic")
    return len(a)


def check(program: Program) -> None:
    """No dyn slot is a host argument; the launch list is the same at two token states; a step that
    samples ends with step_end."""
    host = [d.name for d in program.dyn.values() if d.host]
    if host:
        raise IRError(f"hoist_dynamic: dyn slots {host} are still host arguments")
    _same_launches(program)
    check_routing(program)
    if any(op.kind == "sample" for op in program.ops) and program.ops[-1].kind not in END_OPS:
        raise IRError("hoist_dynamic: the step samples but does not end with step_end")
