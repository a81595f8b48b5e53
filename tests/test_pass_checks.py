"""Every pass's ``check`` proves its invariant and can fail; the pipeline runs each after its pass."""
import copy

import pytest

from kestrel.compiler.frontend import parse_config
from kestrel.compiler.ir import IRError
from kestrel.compiler.presets import PRESETS
from kestrel.compiler.qwen3_5 import lower
from kestrel.passes import pipeline
from kestrel.passes.pipeline import PASS_NAMES, PASSES, PassOptions, pass_named, run_passes

OPTS = PassOptions("sm_90", "q4", 128)


@pytest.fixture(scope="module")
def after():
    """The tiny program after each pass (sm_90, q4)."""
    cfg = parse_config(PRESETS["tiny"], "preset tiny")
    out = {"lower": lower(cfg, 64)}
    run_passes(out["lower"], OPTS, on_pass=lambda name, p: out.__setitem__(name, p))
    return out


def test_each_check_holds_after_its_pass(after):
    for ps in PASSES:
        ps.check(after[ps.name], OPTS)


def test_fuse_check_finds_a_chain_left(after):
    with pytest.raises(IRError, match="fuse: matchable chains left after the pass: .*matmul_swiglu"):
        pass_named("fuse").check(after["lower"], OPTS)


def test_quantize_check_finds_a_wrong_dtype(after):
    with pytest.raises(IRError, match=r"quantize --quant q4: embed_tokens is f32, expected bf16 \(and \d+ more\)"):
        pass_named("quantize").check(after["fuse"], OPTS)
    with pytest.raises(IRError, match="expected bf16"):  # a q4 program is not what --quant bf16 promises
        pass_named("quantize").check(after["quantize"], PassOptions("sm_90", "bf16"))


def test_hoist_dynamic_check_finds_host_slots(after):
    with pytest.raises(IRError, match="still host arguments"):
        pass_named("hoist_dynamic").check(after["quantize"], OPTS)


def test_select_kernels_check_finds_an_op_without_a_kernel(after):
    p = copy.deepcopy(after["select_kernels"])
    op = next(op for op in p.ops if op.launch)
    op.launch = None
    with pytest.raises(IRError, match=f"{op.kind}\\) moves data but has no kernel"):
        pass_named("select_kernels").check(p, OPTS)
    op.launch = {"kernel": "matvec_bf16", "grid": [0, 1, 1], "num_warps": 4}
    with pytest.raises(IRError, match="is not three positive integers"):
        pass_named("select_kernels").check(p, OPTS)


def test_plan_memory_check_finds_a_missing_placement(after):
    p = copy.deepcopy(after["plan_memory"])
    next(iter(p.states.values())).loc = None
    with pytest.raises(IRError, match="placement None is missing"):
        pass_named("plan_memory").check(p, OPTS)


def test_the_pipeline_runs_every_check(after, monkeypatch):
    ran = []
    passes = tuple(pipeline.Pass(ps.name, ps.run, lambda p, o, n=ps.name: ran.append(n)) for ps in PASSES)
    monkeypatch.setattr(pipeline, "PASSES", passes)
    pipeline.run_passes(after["lower"], OPTS)
    assert tuple(ran) == PASS_NAMES


def test_fold_row_norms_folds_gdn_norm_into_the_output_projection_where_the_rule_says(after):
    """With ``gdn_norm.fold`` each one-row gdn_norm and the matmul_add after it become one gdn_norm_matmul_add (the
    tiny model's 3 Gated DeltaNet layers), which the check then finds nothing left of, and which select_kernels
    gives the fused kernel with one partial sum a program; the rule off (the default), nothing changes; with the
    rule on, the check finds a pair put back."""
    from kestrel.kernels.targets import overridden_rules

    quantized = after["quantize"]
    plain = pass_named("fold_row_norms").run(quantized, OPTS)
    assert sum(op.kind == "gdn_norm" for op in plain.ops) == 3
    with overridden_rules("sm_90", "gdn_norm.fold=True"):
        folded = pass_named("fold_row_norms").run(quantized, OPTS)
        fused = [op for op in folded.ops if op.kind == "gdn_norm_matmul_add"]
        assert len(fused) == 3 and not any(op.kind == "gdn_norm" for op in folded.ops)
        pass_named("fold_row_norms").check(folded, OPTS)
        picked = pass_named("select_kernels").run(folded, OPTS)
        op = next(op for op in picked.ops if op.kind == "gdn_norm_matmul_add")
        assert op.launch["kernel"].startswith("gdn_norm_matvec_add_q4g")
        assert op.attrs["partial_rows"] == op.launch["BLOCK_N"]
        assert op.outs[1].type.shape == (op.launch["grid"][0],)
        bad = copy.deepcopy(quantized)  # the pairs unfolded
        pass_named("fold_row_norms").check(bad, PassOptions("cpu", "q4", 128))  # (cpu: the rule does not apply)
        with pytest.raises(IRError, match="3 gdn_norm \\+ matmul_add pairs left unfolded"):
            pass_named("fold_row_norms").check(bad, OPTS)


def test_fold_row_norms_makes_gdn_mixers_one_cluster_launch_where_the_rule_says(after):
    """With ``gdn_cluster.on`` each one-row Gated DeltaNet mixer whose projection takes the partials (the tiny
    model's layers 1 and 2; layer 0's takes the embedding's norm) becomes one rmsnorm_gdn, whose operands are the
    unfused ops' and which select_kernels gives the cluster kernel; the check then finds none left. Off (the
    default), nothing changes; on, the check finds a mixer put back."""
    from kestrel.kernels.targets import overridden_rules

    quantized = after["quantize"]
    plain = pass_named("fold_row_norms").run(quantized, OPTS)
    assert sum(op.kind == "gdn_delta" for op in plain.ops) == 3 and not any(op.kind == "rmsnorm_gdn" for op in plain.ops)
    with overridden_rules("sm_90", "gdn_cluster.on=True gdn_norm.fold=True"):
        folded = pass_named("fold_row_norms").run(quantized, OPTS)
        fused = [op for op in folded.ops if op.kind == "rmsnorm_gdn"]
        assert len(fused) == 2 and sum(op.kind == "gdn_delta" for op in folded.ops) == 1
        # (gdn_norm.fold takes the layer the clusters leave)
        assert sum(op.kind == "gdn_norm_matmul_add" for op in folded.ops) == 1
        op = fused[0]
        assert [getattr(v, "name", None) for v in op.ins[2:]] == [
            f"layers.1.{n}" for n in ("input_layernorm", "linear_attn.in_proj_qkv+in_proj_z+in_proj_b+in_proj_a",
                                      "conv_state", "linear_attn.conv1d", "linear_attn.A_log", "linear_attn.dt_bias",
                                      "linear_attn.norm", "recurrent_state")]
        assert set(op.attrs) == {"eps", "l2_eps", "scale", "norm_eps"}
        pass_named("fold_row_norms").check(folded, OPTS)
        picked = pass_named("select_kernels").run(folded, OPTS)
        op = next(op for op in picked.ops if op.kind == "rmsnorm_gdn")
        assert op.launch["kernel"] == "gdn_cluster_q4g128" and op.launch["CS"] == 8
        assert op.launch["NP"] == op.ins[1].type.shape[0]
        with pytest.raises(IRError, match="2 Gated DeltaNet mixers left unfolded"):
            pass_named("fold_row_norms").check(plain, OPTS)
