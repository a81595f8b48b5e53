"""Kestrel's CPU reference path (fp32) against transformers' Qwen3-Next (qwen3_next: Gated DeltaNet +
gated attention + sparse mixture-of-experts MLPs) on checkpoints it saved itself: the same greedy
tokens for 32 steps and every step's logits within 1e-4 relative (test_oracle.py's measure). Also Qwen3.5's MoE
models (qwen3_5_moe_text / qwen3_5_moe) and FP8 releases of both."""
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_checkpoints import (NEXT_CONFIGS, QWEN35_MOE_CONFIGS, load_fp8_release, make_fp8_release, make_next_checkpoint,
                            make_qwen35_moe_checkpoint)
from test_oracle import check_against_hf


@pytest.mark.parametrize("name", sorted(NEXT_CONFIGS))
def test_next_checkpoints_match_transformers(name, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    model = make_next_checkpoint(ckpt, name)
    check_against_hf(model, ckpt, tmp_path)


def test_next_prefill_rows_match_transformers(tmp_path):
    """The prompt in M-row chunks of 3 (3 + 3 + 1): rows of one chunk route to different experts."""
    ckpt = str(tmp_path / "ckpt")
    model = make_next_checkpoint(ckpt, "e8k2")
    check_against_hf(model, ckpt, tmp_path, prefill_rows=3)


def test_next_fp8_release_matches_transformers(tmp_path):
    """A checkpoint in the format of Qwen's Qwen3-Next FP8 releases (e4m3 projections, experts included, with
    bf16 block scales; compiler/fp8_checkpoint.py): transformers dequantizes it on this GPU-less machine, and
    Kestrel's plan built from the same folder matches it."""
    ckpt = str(tmp_path / "ckpt")
    original = make_next_checkpoint(ckpt, "e8k2").state_dict()
    values = make_fp8_release(ckpt)
    assert sum(".experts." in n for n in values) == 4 * 8 * 3  # every routed expert's three matrices
    model = load_fp8_release(ckpt, "Qwen3NextForCausalLM")
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert torch.equal(model.state_dict()[name], values[name])  # the oracle reads the codes as Kestrel does
    assert not torch.equal(original[name], values[name])  # and they are not the bf16 release's values
    check_against_hf(model, ckpt, tmp_path)


@pytest.mark.parametrize("name", sorted(QWEN35_MOE_CONFIGS))
def test_qwen35_moe_checkpoints_match_transformers(name, tmp_path):
    """Qwen3.5's mixture-of-experts models (qwen3_5_moe_text, the multimodal qwen3_5_moe): Qwen3.5's layers with
    Qwen3-Next's MoE block in every layer; experts one tensor each (as save_pretrained writes them) or fused as
    transformers holds them (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    ckpt = str(tmp_path / "ckpt")
    model = make_qwen35_moe_checkpoint(ckpt, name)
    check_against_hf(model, ckpt, tmp_path)


def test_qwen35_moe_fp8_release_matches_transformers(tmp_path):
    """Qwen3.5 MoE in the FP8 releases' format, as the multimodal wrapper (Qwen3.5-35B-A3B-FP8's layout: experts one
    e4m3 tensor each with bf16 block scales, the vision tower's matrices in FP8 too, skipped with their scales)."""
    ckpt = str(tmp_path / "ckpt")
    make_qwen35_moe_checkpoint(ckpt, "e6k3_multimodal_sharded")
    # make_fp8_release edits one model.safetensors: merge the shards first
    tensors = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "model-*.safetensors"))):
        tensors.update(load_file(f))
        os.remove(f)
    os.remove(os.path.join(ckpt, "model.safetensors.index.json"))
    save_file(tensors, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    values = make_fp8_release(ckpt)
    assert any(".experts.0.down_proj" in n for n in values) and any("visual" in n for n in values)
    model = load_fp8_release(ckpt, "Qwen3_5MoeForConditionalGeneration")
    assert json.load(open(os.path.join(ckpt, "config.json")))["model_type"] == "qwen3_5_moe"
    check_against_hf(model, ckpt, tmp_path)
