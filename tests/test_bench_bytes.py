"""The roofline's numerator and the profile: the bytes a decode step moves (compiler/launch_plan.py's
``step_bytes`` and each launch's ``bytes``) on tiny tied and untied plans, counted here from the
weights and states themselves; the read-only bandwidth probe kernel (kernels/bandwidth.py) in the
interpreter and AOT-compiled; ``kestrel-run --profile`` on the CPU path."""
import json
import subprocess
from pathlib import Path

import pytest
import torch
import triton

from conftest import run_cli
from kernel_harness import interpret
from kestrel.compiler.codegen import compile_kernel
from kestrel.compiler.frontend import parse_config
from kestrel.compiler.ir import SCRATCH_PREFIX, TOKENS_STATE
from kestrel.compiler.launch_plan import launch_list, step_bytes
from kestrel.compiler.presets import PRESETS
from kestrel.compiler.qwen3_5 import lower
from kestrel.kernels.bandwidth import READ_ALIGNED, READ_BLOCK, READ_TYPES, read_stream_kernel, read_stream_launch, read_stream_ref
from kestrel.kernels.targets import TARGETS
from kestrel.passes.pipeline import PassOptions, run_passes
from kestrel.runtime.profile import launch_bytes, layer_kinds


def planned(tied: bool, quant: str = "none", target: str = "sm_90"):
    cfg = parse_config(dict(PRESETS["tiny"], tie_word_embeddings=tied), "tiny")
    return cfg, run_passes(lower(cfg, 64), PassOptions(target, quant))


def expected_fixed(p, cfg, tied: bool) -> int:
    """Every weight whole, except an untied embedding table (one row is gathered); states read and
    written; one token row each way."""
    weights = sum(w.type.nbytes for w in p.weights.values())
    embed = next(w for w in p.weights.values() if w.type.shape == (cfg.vocab_size, cfg.hidden_size)
                 and "embed" in w.name)
    if not tied:
        weights -= embed.type.nbytes - embed.type.nbytes // cfg.vocab_size
    states = sum(2 * s.type.nbytes for n, s in p.states.items()
                 if not n.endswith(("k_cache", "v_cache")) and n != TOKENS_STATE and not n.startswith(SCRATCH_PREFIX))
    return weights + states + 8


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("quant,target", [("none", "sm_90"), ("none", "cpu"), ("q4", "sm_90")])
def test_step_bytes_count_every_weight_once(tied, quant, target):
    cfg, p = planned(tied, quant, target)
    sb = step_bytes(p)
    want = expected_fixed(p, cfg, tied)
    if tied and quant == "q4":  # the lm_head is its own q4 copy of the table: the bf16 table gives one row
        embed = next(w for w in p.weights.values() if "embed" in w.name and not w.type.dtype.startswith("q4"))
        if any(w.type.dtype.startswith("q4") and w.type.shape[0] == cfg.vocab_size for w in p.weights.values()):
            want -= embed.type.nbytes - embed.type.nbytes // cfg.vocab_size
    assert sb["fixed"] == want
    kv = [s for n, s in p.states.items() if n.endswith(("k_cache", "v_cache"))]
    assert sorted(sb["kv_row_bytes"]) == sorted(s.type.nbytes // s.type.shape[0] for s in kv) and kv
    # the per-launch charges add up to the step's
    launches = launch_list(p, {d: 0 for d in p.dyn})
    assert sum(ln["bytes"]["fixed"] for ln in launches) == sb["fixed"]
    assert sum(launch_bytes(ln, 9) for ln in launches) == sb["fixed"] + sum(r * 10 for r in sb["kv_row_bytes"])


def test_tied_table_is_charged_whole_at_the_lm_head():
    """The 0.8B-style tied plan: the embedding gather is charged one row, the lm_head matvec the rest."""
    cfg, p = planned(True)
    launches = launch_list(p, {d: 0 for d in p.dyn})
    table = cfg.vocab_size * cfg.hidden_size * 4
    row = cfg.hidden_size * 4
    assert launches[0]["op"] == "embedding_rmsnorm" and launches[0]["bytes"]["fixed"] == row + cfg.hidden_size * 4
    # (the gather's row, and the first layer's norm weight, charged at the gather that norms it)
    head = next(ln for ln in launches if ln["op"] == "matmul" and ln["layer"] is None)
    assert head["bytes"]["fixed"] == table - row
    _, untied = planned(False)
    lm_head = sum(w.type.nbytes for n, w in untied.weights.items() if "lm_head" in n)
    assert lm_head == table  # untied: the table's row and a separate lm_head; tied: the table once
    assert step_bytes(untied)["fixed"] - step_bytes(p)["fixed"] == row + lm_head - table


def test_layer_kinds():
    _, p = planned(False)
    launches = launch_list(p, {d: 0 for d in p.dyn})
    kinds = layer_kinds(launches)
    assert kinds[0] == "embedding" and kinds[-1] == "head"
    by_layer = {}
    for ln, k in zip(launches, kinds):
        if ln["layer"] is not None:
            by_layer.setdefault(ln["layer"], set()).add(k)
    assert by_layer == {0: {"gdn"}, 1: {"gdn"}, 2: {"gdn"}, 3: {"attention"}}  # tiny: 3 GDN layers, then attention


def test_read_stream_kernel(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-1000, 1000, (3 * READ_BLOCK + 100,), generator=g, dtype=torch.int32)
    tiles = -(-x.numel() // READ_BLOCK)
    out = torch.zeros(2, dtype=torch.int32)
    interpret(read_stream_kernel)[(2,)](x, out, x.numel(), tiles, BLOCK=READ_BLOCK)
    assert torch.equal(out, read_stream_ref(x, 2))
    assert read_stream_launch(1 << 28, 132)["grid"][0] == 8 * 132 and read_stream_launch(100, 132)["grid"][0] == 1
    k = compile_kernel("read_stream", read_stream_kernel, READ_TYPES, {"BLOCK": READ_BLOCK}, 4, TARGETS["sm_90"].cc,
                       READ_ALIGNED)
    assert k.cubin[:4] == b"\x7fELF"
    # 16-byte loads (the probe measured 3.7 TB/s with 4-byte ones): read off the cubin's SASS with the
    # cuobjdump Triton ships
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = tmp_path / "read_stream.cubin"
    cubin.write_bytes(k.cubin)
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert "LDG.E.EF.128" in sass and "LDG.E.EF " not in sass


def test_profile_on_the_cpu_path(tmp_path):
    plan = str(tmp_path / "tiny.plan")
    assert run_cli("kestrelc", "build", "tiny", "--target", "cpu", "--max-seq", "64", "-o", plan).returncode == 0
    out = tmp_path / "profile.json"
    r = run_cli("kestrel-run", plan, "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--profile", str(out))
    assert r.returncode == 0, r.stderr
    assert "layer kind" in r.stdout and "torch.matmul" in r.stdout and "[cpu-reference]" in r.stdout
    rep = json.loads(out.read_text())
    from kestrel.artifacts.plan import load_plan

    lp = load_plan(plan).launch_plan
    assert rep["launches_per_step"] == len(lp["launches"]) == len(rep["launches"])
    assert rep["decode_steps"] == 3 and rep["bandwidth"] is None
    assert sum(g["launches"] for g in rep["by_kernel"].values()) == len(lp["launches"])
    assert set(rep["by_layer_kind"]) == {"embedding", "gdn", "attention", "head"}
    sb = lp["step_bytes"]
    assert rep["bytes_per_step"] == pytest.approx(sb["fixed"] + sum(r * (rep["mean_position"] + 1)
                                                                     for r in sb["kv_row_bytes"]))
    assert all(x["ms"] > 0 for x in rep["launches"])
    assert abs(sum(g["ms"] for g in rep["by_layer_kind"].values()) - rep["sum_of_launches_ms"]) < 1e-9


def test_step_bytes_count_the_routed_experts_only():
    """A MoE layer's stacked experts are charged top_k / E of their bytes a token (the routed experts'
    slices), every other weight whole: on tiny-next (8 experts, top 2), q4 and bf16."""
    from kestrel.compiler.qwen3_5 import lower as lower_any

    cfg = parse_config(PRESETS["tiny-next"], "tiny-next")
    for quant in ("bf16", "q4"):
        p = run_passes(lower_any(cfg, 64), PassOptions("sm_90", quant))
        stacked = {id(w) for w in p.weights.values() if ".mlp.experts." in w.name}  # (whichever op reads them)
        assert stacked
        full = step_bytes(p)["fixed"]
        whole = sum(w.type.nbytes for w in p.weights.values() if id(w) in stacked)
        routed = sum(w.type.nbytes * cfg.num_experts_per_tok // cfg.num_experts for w in p.weights.values()
                     if id(w) in stacked)
        others = expected_fixed(p, cfg, cfg.tie_word_embeddings) - whole
        assert full == others + routed and routed < whole
