"""Fine-grained FP8 checkpoints (compiler/fp8_checkpoint.py) as a build's input: the plan an FP8 release builds is
the plan of a checkpoint holding its dequantized values, byte for byte; a broken FP8 release, or a checkpoint
quantized some other way, is refused in one line before any work. (tests/test_oracle*.py run FP8 releases against
transformers' own dequantizing reader.)"""
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli
from hf_checkpoints import edit_config, edit_tensors, make_fp8_release
from kestrel.artifacts.errors import CheckpointError, ConfigError, UnsupportedError
from kestrel.artifacts.plan import load_plan
from kestrel.compiler.build import build
from kestrel.compiler.fp8_checkpoint import Fp8Blocks, dequantize
from kestrel.compiler.frontend import open_checkpoint
from kestrel.compiler.presets import synthesize

BLOCK = (24, 40)  # divides none of tiny's widths: every matrix has partial blocks at its edges


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return synthesize("tiny", str(tmp_path_factory.mktemp("tiny")))


def _release(src, folder):
    """(a copy of ``src`` as an FP8 release with f32 scales, {matrix: its dequantized fp32 values})."""
    shutil.copytree(src, folder)
    return folder, make_fp8_release(folder, block=BLOCK, scale_dtype=torch.float32)


@pytest.fixture(scope="module")
def fp8_release(tiny_checkpoint, tmp_path_factory):
    return _release(tiny_checkpoint, str(tmp_path_factory.mktemp("fp8") / "ckpt"))


def _weights(path):
    plan = load_plan(path)
    try:
        return {name: bytes(plan.read(name)) for name in plan.weight_names}
    finally:
        plan.close()


@pytest.mark.parametrize("preset, quant, extra", [
    ("tiny", "none", {}), ("tiny", "q4", {}),
    # Qwen3-Next: every routed expert's and the MTP head's matrices in FP8, the draft model in q4 too
    ("tiny-next-mtp", "q4", dict(speculative="mtp", draft_tokens=2)),
])
def test_fp8_release_builds_the_dequantized_checkpoints_plan(preset, quant, extra, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint if preset == "tiny" else synthesize(preset, str(tmp_path / "src"))
    folder, values = _release(src, str(tmp_path / "fp8"))
    plain = str(tmp_path / "plain")
    shutil.copytree(src, plain)
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    tensors.update(values)
    save_file(tensors, os.path.join(plain, "model.safetensors"))
    logs = []
    build(folder, str(tmp_path / "fp8.plan"), target="cpu", quant=quant, log=logs.append, progress=False, **extra)
    build(plain, str(tmp_path / "plain.plan"), target="cpu", quant=quant, log=lambda m: None, progress=False, **extra)
    got, want = _weights(str(tmp_path / "fp8.plan")), _weights(str(tmp_path / "plain.plan"))
    assert got.keys() == want.keys() and len(values) >= 8
    assert [n for n in got if got[n] != want[n]] == []
    assert any(f"FP8 checkpoint: {len(values)} matrices in e4m3 with 24x40 block scales" in m for m in logs), logs
    if preset != "tiny":
        assert any(".experts." in n for n in values) and any(n.startswith("mtp.") for n in values)


def test_dequantize_partial_blocks():
    """Each element times its own block's scale, including the short blocks at the right and bottom edges."""
    q = torch.randn(50, 70).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2) + 0.5
    got = dequantize(q, s, Fp8Blocks(24, 40))
    for i, j in [(0, 0), (23, 39), (24, 40), (47, 0), (48, 69), (49, 41)]:
        assert got[i, j] == q[i, j].float() * s[i // 24, j // 40]  # fp32 product


def _edit(folder, tensors=None, config=None):
    if tensors:
        edit_tensors(folder, tensors, "pt")
    if config:
        edit_config(folder, config)


Q = "model.layers.3.self_attn.q_proj.weight"
S = Q + "_scale_inv"
CASES = {
    "no_quantization_config": (dict(config=lambda c: c.pop("quantization_config")), CheckpointError,
                               "FP8 block scale, but config.json has no quantization_config"),
    "missing_scale": (dict(tensors=lambda t: t.pop(S)), CheckpointError,
                      f"FP8 tensor '{Q}' has no block scale '{S}'"),
    "scale_shape": (dict(tensors=lambda t: t.update({S: torch.ones(3, 3)})), CheckpointError,
                    re.escape(f"'{S}' has shape [3, 3], expected [") + r"\d+, \d+\] \(\[\d+, \d+\] in 24x40 blocks"),
    "scale_dtype": (dict(tensors=lambda t: t.update({S: t[S].to(torch.int32)})), CheckpointError,
                    "FP8 block scales are F32, BF16, F16"),
    "scale_of_a_plain_tensor": (dict(tensors=lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)})),
                                CheckpointError, "'model.norm.weight' has an FP8 block scale but dtype F32"),
    "orphan_scale": (dict(tensors=lambda t: t.update({"model.layers.0.extra.weight_scale_inv": torch.ones(1, 1)})),
                     CheckpointError, "an FP8 block scale without its matrix 'model.layers.0.extra.weight'"),
    "e5m2": (dict(tensors=lambda t: t.update({Q: t[Q].to(torch.float8_e5m2)})), CheckpointError,
             "has an FP8 block scale but dtype F8_E5M2"),
    "gptq": (dict(config=lambda c: c["quantization_config"].update(quant_method="gptq")), UnsupportedError,
             "quantized \\(quantization_config quant_method 'gptq'\\); Kestrel reads unquantized"),
    "static_activations": (dict(config=lambda c: c["quantization_config"].update(activation_scheme="static")),
                           UnsupportedError,
                           "activation_scheme 'static'"),
    "per_tensor": (dict(config=lambda c: c["quantization_config"].pop("weight_block_size")), UnsupportedError,
                   "per-tensor FP8 \\(no weight_block_size\\)"),
    "bad_block": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[128])), ConfigError,
                  "weight_block_size must be two positive integers"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_fp8_release(case, fp8_release, tmp_path):
    edits, err, pattern = CASES[case]
    folder = str(tmp_path / "ckpt")
    shutil.copytree(fp8_release[0], folder)
    _edit(folder, **edits)
    with pytest.raises(err, match=pattern):
        open_checkpoint(folder)


def test_fp8_codes_that_are_nan_are_refused_in_one_line(fp8_release, tmp_path):
    """e4m3's NaN code (0x7f) in a matrix: the build stops naming the tensor (exit 4), the plan not written."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(fp8_release[0], folder)

    def poison(t):
        codes = t[Q].view(torch.uint8).clone()
        codes[1, 2] = 0x7F
        t[Q] = codes.view(torch.float8_e4m3fn)
    _edit(folder, tensors=poison)
    out = tmp_path / "m.plan"
    r = run_cli("kestrelc", "build", folder, "-o", str(out), "--target", "cpu")
    assert r.returncode == CheckpointError.exit_code, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"tensor '{Q}' holds 1 non-finite values" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_fused_fp8_experts_are_refused(tmp_path):
    """Experts fused in one 3-D FP8 tensor (no FP8 release stores them so) are refused naming the tensor."""
    folder = synthesize("tiny-moe", str(tmp_path / "ckpt"))
    make_fp8_release(folder, block=BLOCK, scale_dtype=torch.float32)

    def fuse(t):
        p = "model.layers.0.mlp.experts."
        t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight").float(),
                                                        t.pop(f"{p}{e}.up_proj.weight").float()])
                                             for e in range(8)]).to(torch.float8_e4m3fn)
        for e in range(8):
            for proj in ("gate_proj", "up_proj"):
                t.pop(f"{p}{e}.{proj}.weight_scale_inv")
    _edit(folder, tensors=fuse)
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.experts.gate_up_proj' holds fused experts in FP8"):
        open_checkpoint(folder)
