"""The op registry (compiler/ops.py): every op kind has every part of its record — shape rule, CPU
reference, GPU kernel and launch rule, ONNX lowering — or declares the part not applicable, saying
why; and the parts agree with each other and with the kernels' signatures."""
import inspect
import re

import pytest
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kestrel.compiler.frontend import parse_config
from kestrel.compiler.ops import OPS, Kernel, NotApplicable, is_view, scalar_attrs
from kestrel.compiler.presets import PRESETS
from kestrel.compiler.qwen3_5 import lower, lower_speculative
from kestrel.passes.pipeline import PassOptions, run_passes


def _declared(part) -> bool:
    return callable(part) or (isinstance(part, NotApplicable) and len(part.why) > 10)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_has_every_part(name):
    d = OPS[name]
    assert d.name == name and d.operands and set(d.operands) <= set("vwsdt"), d.operands
    assert callable(d.infer) and callable(d.reference)  # every op runs on the CPU reference path
    assert isinstance(d.kernel, (Kernel, NotApplicable)) and _declared(d.onnx), name
    if isinstance(d.kernel, Kernel):
        assert isinstance(d.kernel.jit, (JITFunction, InterpretedFunction)) and callable(d.kernel.launch)
    else:
        assert len(d.kernel.why) > 10
    assert all(0 <= i < len(d.operands) and d.operands[i] == "s" for i in d.inout), "inout names state operands"
    # the reference takes exactly the operands, then the attributes by name, and the options (absent or given)
    inspect.signature(d.reference).bind(*[None] * len(d.operands), **{a: None for a in d.attrs + d.options})
    if isinstance(d.kernel, Kernel) and d.options:  # an option is its kernels' constexpr by that name, None absent
        for jit in {d.kernel.jit, d.kernel.rows, *(j for _, j in d.kernel.variants)} - {None}:
            params = inspect.signature(getattr(jit, "fn", jit)).parameters
            assert all(o.upper() in params and params[o.upper()].default is None for o in d.options), (name, jit)
    if callable(d.onnx):
        inspect.signature(d.onnx).bind(None, None, *[None] * len(d.operands))


def _tiny_gpu_program(rows: int = 0, quant: str = "q4"):
    cfg = parse_config(PRESETS["tiny"], "preset tiny")
    one = run_passes(lower(cfg, 64), PassOptions("sm_90", quant))
    if not rows:
        return one
    return run_passes(lower(cfg, 64, rows=rows), PassOptions("sm_90", quant, shares_arena_with=one))


def _tiny_speculative_programs():
    """The speculative prefill and iteration of tiny-mtp (K = 2) for sm_90, q4."""
    cfg = parse_config(PRESETS["tiny-mtp"], "preset tiny-mtp")
    rows = _tiny_gpu_program(rows=8)
    pre = run_passes(lower_speculative(cfg, 64, 2, prefill_rows=8), PassOptions("sm_90", "q4", shares_arena_with=rows))
    return pre, run_passes(lower_speculative(cfg, 64, 2), PassOptions("sm_90", "q4", shares_arena_with=pre))


def _tiny_next_programs():
    """tiny-next (Qwen3-Next, MoE) for sm_90, q4: the one-token step, the 8-row step (each row's experts) and the
    16-row one (grouped by expert)."""
    cfg = parse_config(PRESETS["tiny-next"], "preset tiny-next")
    one = run_passes(lower(cfg, 64), PassOptions("sm_90", "q4"))
    return one, *(run_passes(lower(cfg, 64, rows=r), PassOptions("sm_90", "q4", shares_arena_with=one)) for r in (8, 16))


def _without_q4_mma(programs):
    """``programs()`` built with the tensor-core q4 kernel turned off (kernels/q4_mma.py): the few-rows q4
    matvecs and grouped kernels it replaces, still the fallback where it does not fit."""
    import dataclasses

    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    TARGETS["sm_90"] = dataclasses.replace(t, rules={**t.rules, "q4_mma": dataclasses.replace(
        t.rules["q4_mma"], max_rows=0, grouped_rows=0)})
    try:
        return programs()
    finally:
        TARGETS["sm_90"] = t


def _without_bf16_fold(programs):
    """``programs()`` built with the bf16 tensor-core kernel's folding turned off (passes/fold_row_norms.py):
    its plain and gate / up forms, which the fold otherwise replaces in the tiny programs."""
    import dataclasses

    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    TARGETS["sm_90"] = dataclasses.replace(t, rules={**t.rules, "bf16_mma": dataclasses.replace(
        t.rules["bf16_mma"], fold_norms=False)})
    try:
        return programs()
    finally:
        TARGETS["sm_90"] = t


def _with_q4_stream(programs):
    """``programs()`` built with the bulk-copy q4 kernel (kernels/q4_stream.py) taking every form at the tiny
    shapes (by default only the 27B-class normed gate / up pair)."""
    import dataclasses

    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    TARGETS["sm_90"] = dataclasses.replace(t, rules={**t.rules, "q4_stream": dataclasses.replace(
        t.rules["q4_stream"], pair=True, add=True, plain=True, norm_plain=True, rb=8, nc=2, pair_rb=8, pair_nc=2,
        min_rows=1, min_k=0)})
    try:
        return programs()
    finally:
        TARGETS["sm_90"] = t


def _with_step_order_attention(programs):
    """``programs()`` built with the speculative verify's attention rows in step order (attn_rows_step_kernel,
    rule attn_rows.step_order_rows, off by default)."""
    import dataclasses

    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    TARGETS["sm_90"] = dataclasses.replace(t, rules={**t.rules, "attn_rows": dataclasses.replace(
        t.rules["attn_rows"], step_order_rows=4)})
    try:
        return programs()
    finally:
        TARGETS["sm_90"] = t


def test_kernel_parameters_match_each_ops_operands_results_and_attributes():
    """The ABI (compiler/codegen.py): one pointer per operand and result, one scalar per attribute."""
    seen, jits = set(), set()
    for prog in (_tiny_gpu_program(), _tiny_gpu_program(rows=8), _tiny_gpu_program(rows=32),
                 _tiny_gpu_program(rows=4, quant="bf16"), *_tiny_speculative_programs(), *_tiny_next_programs(),
                 *_without_q4_mma(lambda: (_tiny_gpu_program(rows=8), *_tiny_next_programs())),
                 *_without_bf16_fold(lambda: (_tiny_gpu_program(rows=4, quant="bf16"),)),
                 *_with_q4_stream(lambda: (_tiny_gpu_program(), *_tiny_speculative_programs())),
                 *_with_step_order_attention(_tiny_speculative_programs)):
        for op in prog.ops:
            if is_view(op):
                continue
            kernel = OPS[op.kind].kernel
            assert isinstance(kernel, Kernel), f"{op.kind} reached a GPU program without a kernel"
            jit = kernel.jit_for(op)
            runtime_params = [a for a in jit.arg_names if not a.isupper()]
            assert len(runtime_params) == len(op.ins) + len(op.outs) + len(scalar_attrs(op)), (op.kind, runtime_params)
            seen.add(op.kind)
            jits.add(jit)
    with_kernel = {n for n, d in OPS.items() if isinstance(d.kernel, Kernel)}
    assert seen == with_kernel  # every kernel of the registry is exercised by the fused programs ...
    rows_jits = {d.kernel.rows for d in OPS.values() if isinstance(d.kernel, Kernel) and d.kernel.rows is not None}
    assert rows_jits and rows_jits <= jits  # ... the M-row variants (GEMM) included ...
    variant_jits = {j for d in OPS.values() if isinstance(d.kernel, Kernel) for _, j in d.kernel.variants}
    assert variant_jits and variant_jits <= jits  # ... and those at a few rows (the few-rows matvec, q4_mma, bf16_mma)
    # and the bulk-copy q4 kernel's forms at one row, and the verify's step-order attention rows


def test_ops_without_a_kernel_are_refused_on_gpu_targets_with_the_reason():
    from kestrel.compiler.ir import IRError
    from kestrel.passes.select_kernels import select_kernels

    cfg = parse_config(PRESETS["tiny"], "preset tiny")
    unfused = lower(cfg, 64)
    kind = next(op.kind for op in unfused.ops if isinstance(OPS[op.kind].kernel, NotApplicable) and not is_view(op))
    with pytest.raises(IRError, match=re.escape(f"op '{kind}' has no GPU kernel for sm_90: {OPS[kind].kernel.why}")):
        select_kernels(unfused, "sm_90")


def test_the_routers_logits_keep_fp32_activations_at_m_rows():
    """The router's matmul (its logits read by moe_topk) runs the few-rows matvec at every M, the 16-row
    step's included, where any other matmul takes the bf16 tensor-core GEMM; select_kernels' check refuses
    a GEMM there."""
    from kestrel.compiler.ir import IRError
    from kestrel.passes import select_kernels

    for prog in _tiny_next_programs()[1:]:
        routing = {id(op.ins[0]) for op in prog.ops if op.kind == "moe_topk"}
        routers = [op for op in prog.ops if op.kind == "matmul" and id(op.outs[0]) in routing]
        assert len(routers) == 4 and all(op.launch["kernel"] == "matvec_rows_bf16" for op in routers)
    grouped = _tiny_next_programs()[2]
    assert any(op.launch["kernel"].startswith("gemm_") for op in grouped.ops if op.kind == "matmul")
    router = next(op for op in grouped.ops if op.kind == "matmul" and op.launch["kernel"].startswith("matvec_rows"))
    router.launch["kernel"] = "gemm_bf16"
    with pytest.raises(IRError, match="router's logits at M rows must come from the few-rows matvec"):
        select_kernels.check(grouped)


def test_grouped_moe_ops_check_their_routing_operands():
    """moe_gate_up_grouped / moe_down_grouped refuse a chunk table that is not i32 [C, 4] and a src that is
    not i32 [M k] (each named in the message)."""
    from kestrel.compiler.ir import IRError

    grouped = _tiny_next_programs()[2]
    gu = next(op for op in grouped.ops if op.kind == "moe_gate_up_grouped")
    dn = next(op for op in grouped.ops if op.kind == "moe_down_grouped")
    x, src, chunks, wg, wu = gu.ins
    OPS["moe_gate_up_grouped"].infer(gu.ins, gu.attrs)  # as built: accepted
    with pytest.raises(IRError, match="moe_gate_up_grouped: the chunk table must be i32 \\[C, 4\\]"):
        OPS["moe_gate_up_grouped"].infer([x, src, src, wg, wu], gu.attrs)
    with pytest.raises(IRError, match="moe_gate_up_grouped: x \\[M, H\\] and src i32"):
        OPS["moe_gate_up_grouped"].infer([x, chunks, chunks, wg, wu], gu.attrs)
    with pytest.raises(IRError, match="moe_down_grouped: the chunk table"):
        OPS["moe_down_grouped"].infer([dn.ins[0], src, dn.ins[2]], dn.attrs)
