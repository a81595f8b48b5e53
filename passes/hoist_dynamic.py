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
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import TOKENS_STATE, IRError, Op, Program
from kestrel.compiler.launch_plan import launch_list


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
    if not any(op.kind in END_OPS for op in program.ops):
        raise IRError("the step does not advance pos itself (no step_end): the host would write per token; "
                      "run hoist_dynamic")
    return n


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
    if any(op.kind == "sample" for op in program.ops) and program.ops[-1].kind not in END_OPS:
        raise IRError("hoist_dynamic: the step samples but does not end with step_end")
