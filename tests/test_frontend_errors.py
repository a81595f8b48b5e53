"""Bad checkpoints and options: one clear line, a distinct exit code, no traceback, nothing written."""
import json
import re
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import run_cli
from hf_checkpoints import edit_config, edit_tensors
from kestrel.artifacts.errors import CheckpointError, ConfigError, InputError, OutputError, UnsupportedError
from kestrel.compiler.presets import synthesize


def _set(d, k, v):
    d[k] = v


def _pop(d, k):
    d.pop(k)


CASES = {
    "unknown_model_type": (lambda f: edit_config(f, lambda c: _set(c, "model_type", "llama")),
                           ConfigError, "unknown model_type 'llama'"),
    # a Qwen3.5 checkpoint whose config says qwen3_next: its tensors are not a Qwen3-Next model's
    "qwen3_next_config_on_qwen35": (lambda f: edit_config(f, lambda c: _set(c, "model_type", "qwen3_next")),
                                    CheckpointError, "not part of a qwen3_next model"),
    "missing_key": (lambda f: edit_config(f, lambda c: _pop(c, "hidden_size")), ConfigError, "missing key 'hidden_size'"),
    "inconsistent_heads": (lambda f: edit_config(f, lambda c: _set(c, "num_attention_heads", 3)),
                           ConfigError, "multiple of num_key_value_heads"),
    "bad_layer_types": (lambda f: edit_config(f, lambda c: _set(c, "layer_types", ["linear_attention"] * 3)),
                        ConfigError, "'layer_types' must list 4 entries"),
    "not_json": (lambda f: open(os.path.join(f, "config.json"), "w").write("{oops"), ConfigError, "not valid JSON"),
    "no_config": (lambda f: os.remove(os.path.join(f, "config.json")), ConfigError, "no config.json"),
    "missing_tensor": (lambda f: edit_tensors(f, lambda t: _pop(t, "model.layers.1.mlp.up_proj.weight")),
                       CheckpointError, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "wrong_shape": (lambda f: edit_tensors(f, lambda t: _set(t, "model.layers.3.self_attn.k_proj.weight",
                                                             np.zeros((64, 129), np.float32))),
                    CheckpointError, r"'model.layers.3.self_attn.k_proj.weight' has shape \[64, 129\], expected \[64, 128\]"),
    "bad_dtype": (lambda f: edit_tensors(f, lambda t: _set(t, "model.norm.weight", np.zeros(128, np.int64))),
                  CheckpointError, "dtype I64"),
    # experts stored fused in a dense model: not its tensors (they are not split into per-expert names first)
    "fused_experts_in_a_dense_model": (lambda f: edit_tensors(f, lambda t: _set(
        t, "model.layers.0.mlp.experts.gate_up_proj", np.zeros((8, 128, 128), np.float32))),
        CheckpointError, "unexpected tensor 'model.layers.0.mlp.experts.gate_up_proj': not part of a qwen3_5_text"),
    "unexpected_tensor": (lambda f: edit_tensors(f, lambda t: _set(t, "model.layers.0.mlp.extra.weight",
                                                                   np.zeros(2, np.float32))),
                          CheckpointError, "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    "no_weights": (lambda f: os.remove(os.path.join(f, "model.safetensors")), CheckpointError,
                   "no model.safetensors"),
}


NEXT_CASES = {
    "missing_expert": (lambda t: _pop(t, "model.layers.2.mlp.experts.5.up_proj.weight"),
                       re.escape("missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight' (expected shape [64, 128])")),
    "missing_layer_of_experts": (lambda t: [_pop(t, k) for k in list(t) if k.startswith("model.layers.1.mlp.experts.")],
                                 r"missing tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' \(expected shape "
                                 r"\[64, 128\]; 23 more tensors missing\)"),
    "misshapen_expert": (lambda t: _set(t, "model.layers.0.mlp.experts.7.down_proj.weight", np.zeros((128, 32), np.float32)),
                         r"'model.layers.0.mlp.experts.7.down_proj.weight' has shape \[128, 32\], expected \[128, 64\]"),
    "misshapen_router": (lambda t: _set(t, "model.layers.3.mlp.gate.weight", np.zeros((9, 128), np.float32)),
                         r"'model.layers.3.mlp.gate.weight' has shape \[9, 128\], expected \[8, 128\]"),
    "unfused_gdn": (lambda t: _set(t, "model.layers.0.linear_attn.in_proj_qkv.weight", np.zeros((2, 2), np.float32)),
                    "unexpected tensor 'model.layers.0.linear_attn.in_proj_qkv.weight'"),
}


# a Qwen3-Next MTP head (tiny-next-mtp, built with --speculative mtp): its layer's MoE block checked like the model's
NEXT_MTP_CASES = {
    "missing_head_expert": (lambda t: _pop(t, "mtp.layers.0.mlp.experts.3.down_proj.weight"),
                            re.escape("missing tensor 'mtp.layers.0.mlp.experts.3.down_proj.weight' (expected shape "
                                      "[128, 64])")),
    "misshapen_head_router": (lambda t: _set(t, "mtp.layers.0.mlp.gate.weight", np.zeros((8, 64), np.float32)),
                              r"'mtp.layers.0.mlp.gate.weight' has shape \[8, 64\], expected \[8, 128\]"),
    "dense_head_mlp": (lambda t: _set(t, "mtp.layers.0.mlp.gate_proj.weight", np.zeros((384, 128), np.float32)),
                       "unexpected tensor 'mtp.layers.0.mlp.gate_proj.weight'"),
}


@pytest.fixture(scope="module")
def next_checkpoint(tmp_path_factory):
    return synthesize("tiny-next", str(tmp_path_factory.mktemp("next")))


@pytest.fixture(scope="module")
def next_mtp_checkpoint(tmp_path_factory):
    return synthesize("tiny-next-mtp", str(tmp_path_factory.mktemp("next-mtp")))


def _refused_in_one_line(src, edit, pattern, tmp_path, *args):
    """A copy of checkpoint ``src`` with its tensors edited by ``edit`` is refused naming the tensor in one
    line (exit 4), before anything is written."""
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(src, ckpt)
    edit_tensors(ckpt, edit)
    out = tmp_path / "m.plan"
    r = run_cli("kestrelc", "build", ckpt, "-o", str(out), *args)
    assert r.returncode == CheckpointError.exit_code, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), r.stderr


@pytest.mark.parametrize("case", sorted(NEXT_CASES))
def test_broken_qwen3_next_checkpoint(case, next_checkpoint, tmp_path):
    """Missing or misshapen expert tensors are named in one line (exit 4), before anything is written."""
    _refused_in_one_line(next_checkpoint, *NEXT_CASES[case], tmp_path)


@pytest.mark.parametrize("case", sorted(NEXT_MTP_CASES))
def test_broken_qwen3_next_mtp_head(case, next_mtp_checkpoint, tmp_path):
    """--speculative mtp on a Qwen3-Next checkpoint: a missing or misshapen tensor of the head's MoE block, or a
    dense MLP where the head's layer has a MoE block, named in one line (exit 4)."""
    _refused_in_one_line(next_mtp_checkpoint, *NEXT_MTP_CASES[case], tmp_path, "--speculative", "mtp")


def test_qwen3_next_config_errors(tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(synthesize("tiny-next", str(tmp_path / "src")), ckpt)
    edit_config(ckpt, lambda c: _set(c, "num_experts_per_tok", 9))
    r = run_cli("kestrelc", "build", ckpt, "-o", str(tmp_path / "m.plan"))
    assert r.returncode == ConfigError.exit_code and "num_experts_per_tok 9 is more than num_experts 8" in r.stderr
    r = run_cli("kestrelc", "build", "qwen3-next-80b-a3b", "--weights", "random", "--target", "sm_90",
                "-o", str(tmp_path / "big.plan"))
    assert r.returncode == 12 and not (tmp_path / "big.plan").exists()
    assert re.search(r"error: qwen3-next-80b-a3b at --quant bf16 needs a 159\.\d GB arena .* the largest sm_90 GPU "
                     r"\(H200 SXM\) has 150\.8 GB: build with --quant q4", r.stderr), r.stderr


def _fuse_experts(t, layer=0, n=8, down_shape=None, p=None):
    """Layer ``layer``'s experts of tiny-moe (or those under ``p``) stored fused, as transformers holds them."""
    p = p or f"model.layers.{layer}.mlp.experts."
    t[p + "gate_up_proj"] = np.stack([np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"),
                                                      t.pop(f"{p}{e}.up_proj.weight")]) for e in range(n)])
    down = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    t[p + "down_proj"] = down if down_shape is None else np.zeros(down_shape, np.float32)


QWEN35_MOE_CASES = {
    "fused_misshapen": (lambda t: _fuse_experts(t, down_shape=(8, 128, 32)),
                        re.escape("'model.layers.0.mlp.experts.down_proj' has shape [8, 128, 32], expected "
                                  "[8, 128, 64] (fused experts)")),
    "fused_and_per_expert": (lambda t: (_fuse_experts(t), t.update({"model.layers.0.mlp.experts.3.up_proj.weight":
                                                                    np.zeros((64, 128), np.float32)})),
                             "experts stored twice: 'model.layers.0.mlp.experts.gate_up_proj' and "
                             "'model.layers.0.mlp.experts.3.up_proj.weight'"),
    "missing_expert": (lambda t: _pop(t, "model.layers.2.mlp.experts.5.down_proj.weight"),
                       re.escape("missing tensor 'model.layers.2.mlp.experts.5.down_proj.weight' "
                                 "(expected shape [128, 64])")),
    "fused_nan": (lambda t: (_fuse_experts(t),
                             t["model.layers.0.mlp.experts.down_proj"].__setitem__((3, 5, 7), np.nan)),
                  re.escape("tensor 'model.layers.0.mlp.experts.down_proj' (expert 3) holds 1 non-finite values")),
    "fused_gdn": (lambda t: _set(t, "model.layers.0.linear_attn.in_proj_qkvz.weight", np.zeros((2, 2), np.float32)),
                  "unexpected tensor 'model.layers.0.linear_attn.in_proj_qkvz.weight'"),
}


@pytest.fixture(scope="module")
def qwen35_moe_checkpoint(tmp_path_factory):
    return synthesize("tiny-moe", str(tmp_path_factory.mktemp("q35moe")))


@pytest.mark.parametrize("case", sorted(QWEN35_MOE_CASES))
def test_broken_qwen35_moe_checkpoint(case, qwen35_moe_checkpoint, tmp_path):
    """Qwen3.5 MoE: fused experts of the wrong shape or stored in both layouts, a missing expert, Qwen3-Next's fused
    GDN projection: named in one line (exit 4), before anything is written."""
    _refused_in_one_line(qwen35_moe_checkpoint, *QWEN35_MOE_CASES[case], tmp_path)


def test_qwen35_moe_fused_experts_build_the_per_expert_plan(qwen35_moe_checkpoint, tmp_path):
    """Experts stored fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]) build the plan of the same experts stored
    one tensor each, byte for byte (only the source path differs)."""
    import shutil

    from kestrel.artifacts.plan import load_plan
    from kestrel.compiler.build import build

    fused = str(tmp_path / "fused")
    shutil.copytree(qwen35_moe_checkpoint, fused)
    edit_tensors(fused, lambda t: [_fuse_experts(t, layer) for layer in range(4)])
    parts = []
    for src, name in ((qwen35_moe_checkpoint, "a"), (fused, "b")):
        build(src, str(tmp_path / f"{name}.plan"), target="cpu", quant="q4", log=lambda m: None, progress=False)
        plan = load_plan(str(tmp_path / f"{name}.plan"))
        parts.append({n: bytes(plan.read(n)) for n in plan.weight_names})
        plan.close()
    assert parts[0] == parts[1] and len(parts[0]) > 10


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    return synthesize("tiny", str(tmp_path_factory.mktemp("good")))


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint(case, good_checkpoint, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(good_checkpoint, ckpt)
    breaker, err, message = CASES[case]
    breaker(ckpt)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = run_cli("kestrelc", "build", ckpt, "-o", str(out_dir / "m.plan"))
    assert r.returncode == err.exit_code, r.stderr
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    import re

    assert re.search(message, lines[0]), lines[0]
    assert list(out_dir.iterdir()) == []  # nothing written, not even a partial file


@pytest.mark.parametrize("args, err, message", [
    (["--target", "sm_75"], UnsupportedError, "--target sm_75: unknown target"),
    (["--quant", "q8"], UnsupportedError, "--quant q8: unknown precision"),
    (["--dump-ir-after", "nope"], InputError, "--dump-ir-after nope"),
    (["--max-seq", "100000"], InputError, "max_position_embeddings"),
])
def test_bad_build_options(args, err, message, tmp_path):
    r = run_cli("kestrelc", "build", "tiny", "-o", str(tmp_path / "m.plan"), *args)
    assert r.returncode == err.exit_code and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m.plan").exists()


def test_output_folder_missing(tmp_path):
    r = run_cli("kestrelc", "build", "tiny", "-o", str(tmp_path / "no" / "m.plan"))
    assert r.returncode == OutputError.exit_code and "does not exist" in r.stderr


def test_not_a_folder_nor_preset(tmp_path):
    r = run_cli("kestrelc", "build", str(tmp_path / "nothing"), "-o", str(tmp_path / "m.plan"))
    assert r.returncode == ConfigError.exit_code and "no such checkpoint folder (or preset name)" in r.stderr


def test_sharded_index_with_missing_shard(good_checkpoint, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(good_checkpoint, ckpt)
    t = load_file(os.path.join(ckpt, "model.safetensors"))
    names = sorted(t)
    half = len(names) // 2
    save_file({k: t[k] for k in names[:half]}, os.path.join(ckpt, "model-00001-of-00002.safetensors"))
    os.remove(os.path.join(ckpt, "model.safetensors"))
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(names)}
    json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(ckpt, "model.safetensors.index.json"), "w"))
    r = run_cli("kestrelc", "build", ckpt, "-o", str(tmp_path / "m.plan"))
    assert r.returncode == CheckpointError.exit_code and "model-00002-of-00002.safetensors" in r.stderr


def test_qwen35_moe_fused_head_experts(tmp_path):
    """The MTP head's experts fused: skipped as one part of the head without --speculative (its tensors counted as
    stored), read as per-expert slices with it."""
    from kestrel.compiler.frontend import open_checkpoint

    folder = synthesize("tiny-moe-mtp", str(tmp_path / "ckpt"))
    want = load_file(os.path.join(folder, "model.safetensors"))["mtp.layers.0.mlp.experts.3.up_proj.weight"]
    edit_tensors(folder, lambda t: _fuse_experts(t, p="mtp.layers.0.mlp.experts."))
    plain = open_checkpoint(folder)
    assert "skipping the multi-token-prediction head (19 tensors)" in plain.notices[0], plain.notices
    head = open_checkpoint(folder, mtp=True)
    assert np.array_equal(head.read("mtp.layers.0.mlp.experts.3.up_proj.weight").numpy(), want)
