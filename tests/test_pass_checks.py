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
