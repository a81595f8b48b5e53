"""The dyn-invariance check covers Qwen3-Next's routing buffers (passes/hoist_dynamic.py check_routing):
on a tiny-next sm_90 plan the launch list is the same for tokens that route to different experts, and
the check fails when an expert id is baked into a kernel argument, when a single expert's weight is
read, or when the routing buffer is read by anything but the expert kernels."""
import copy

import pytest

from kestrel.artifacts.plan import load_plan
from kestrel.compiler.build import build
from kestrel.compiler.ir import IRError, Op
from kestrel.compiler.ir_text import parse_program
from kestrel.compiler.launch_plan import launch_list
from kestrel.passes.hoist_dynamic import check_dyn_invariance, check_routing
from kestrel.runtime.cpu import CpuStep


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("next") / "tiny-next.plan")
    build("tiny-next", path, target="sm_90", quant="q4", max_seq=32, log=lambda m: None, progress=False,
          prefill_rows=8)
    return load_plan(path)


def test_launch_list_same_whichever_experts_run(plan):
    program = parse_program(plan.program_text)
    rows = parse_program(plan.prefill_program_text)
    assert check_routing(program) == 4 and check_routing(rows) == 4  # one routing buffer per layer
    check_dyn_invariance(program)
    before = launch_list(program)
    cpu = CpuStep(plan)
    cpu.begin([7, 100, 3], 0.0, 1.0, 0)
    routers = [op for op in cpu.program.ops if op.kind == "moe_topk"]
    chosen = []
    for _ in range(6):
        cpu.run()
        chosen.append(tuple(tuple(cpu.values[id(op.outs[0])].tolist()) for op in routers))
    assert len(set(chosen)) > 1, "the tokens all routed to the same experts: the test would prove nothing"
    assert launch_list(program) == before == launch_list(parse_program(plan.program_text))
    # the plan's stored launches (what the runtime replays) carry no expert id: the same kernels, grids and
    # arguments as the program's, and no scalar at all for the expert kernels
    # (moe_gate_up's scalar is the expert count, 8; the fused ones' the norm's eps and the partials' rows)
    stored = [ln for ln in plan.launch_plan["launches"]
              if ln["op"] in ("moe_gate_up", "moe_down", "rmsnorm_moe_gate_up", "moe_down_add")]
    assert {ln["op"] for ln in stored} >= {"rmsnorm_moe_gate_up", "moe_down_add"}
    assert all(ln["scalars"] in ([], [8], [8, 1e-6]) or ln["op"] == "moe_down_add" and len(ln["scalars"]) == 1
               for ln in stored)


def _gate_up(program):
    """The one-row program's grouped gate/up op (the post-attention norm folded in) and its stacked gate."""
    op = next(op for op in program.ops if op.kind in ("moe_gate_up", "rmsnorm_moe_gate_up"))
    return op


def test_fails_when_an_expert_id_is_a_kernel_argument(plan):
    program = parse_program(plan.program_text)
    op = _gate_up(program)
    op.launch = dict(op.launch, EXPERT=3)  # what a host-routed step would pass: this token's expert
    with pytest.raises(IRError, match="baked into a kernel argument"):
        check_dyn_invariance(program)
    program = parse_program(plan.program_text)
    op = _gate_up(program)
    op.launch = dict(op.launch, grid=[op.launch["grid"][0] - 1, 1, 1])  # a grid fitted to this token's experts
    with pytest.raises(IRError, match="baked into a kernel argument"):
        check_routing(program)


def test_fails_on_a_single_experts_weight(plan):
    program = parse_program(plan.program_text)
    op = _gate_up(program)
    i = 4 if op.kind == "rmsnorm_moe_gate_up" else 2
    w = op.ins[i]
    one = copy.copy(w)
    one.name = w.name.replace(".experts.", ".experts.3.")
    program.weights[one.name] = one
    op.ins[i] = one
    with pytest.raises(IRError, match="one expert's"):
        check_routing(program)


def test_fails_when_the_routing_buffer_is_read_as_something_else(plan):
    program = parse_program(plan.program_text)
    router = next(op for op in program.ops if op.kind == "moe_topk")
    w = next(op for op in program.ops if op.outs and op.outs[0] is router.ins[0]).ins[-1]  # the router's weight (its last operand)
    program.ops.insert(program.ops.index(router) + 1, Op("matmul", [router.outs[1]], [router.outs[0], w]))
    with pytest.raises(IRError, match="reads a routing buffer"):
        check_routing(program)
