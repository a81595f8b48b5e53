"""Kestrel's CPU reference path (fp32) against transformers' Qwen3.5 on checkpoints it saved itself.

Same greedy tokens for 32 steps, and every step's logits within 1e-4 relative, measured as
max|kestrel - hf| / max|hf| over the vocabulary (an elementwise ratio is meaningless near zero).
"""
import pytest
import torch

from hf_checkpoints import (CONFIGS, hf_greedy, load_fp8_release, make_fp8_release, make_multimodal_checkpoint,
                            make_text_checkpoint)
from kestrel.artifacts.plan import load_plan
from kestrel.compiler.build import build
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.generate import SamplingParams, generate

N_NEW = 32
PROMPT = [5, 17, 42, 99, 3, 150, 7]


def kestrel_greedy(ckpt: str, plan_path: str, prefill_rows: int | None = None):
    """Tokens from the plain (batched read-back) token loop; logits from the one-step-at-a-time loop,
    whose tokens must be the same. The prompt is prefilled by the M-row step (``prefill_rows``;
    default: the cpu default, 64, one chunk) or, with 0, one token a step."""
    build(ckpt, plan_path, max_seq=64, log=lambda m: None, progress=False, prefill_rows=prefill_rows)
    plan = load_plan(plan_path)
    step = CpuStep(plan)
    plan.close()
    gen = generate(step, PROMPT, N_NEW, SamplingParams())
    logits = []

    def record(step, phase, pos, token_in):
        if pos >= len(PROMPT) - 1:  # the steps that produced a generated token
            logits.append(torch.from_numpy(step.output("logits").copy()))

    stepwise = generate(step, PROMPT, N_NEW, SamplingParams(), on_step=record)
    assert stepwise.tokens == gen.tokens
    return gen.tokens, torch.stack(logits)


def check_against_hf(model, ckpt, tmp_path, prefill_rows=None):
    hf_tokens, hf_logits = hf_greedy(model, PROMPT, N_NEW)
    k_tokens, k_logits = kestrel_greedy(ckpt, str(tmp_path / "m.plan"), prefill_rows)
    assert k_tokens == hf_tokens
    assert len(set(hf_tokens)) > 3, "degenerate test: the model repeats one token"
    rel = ((k_logits - hf_logits).abs().amax(dim=1) / hf_logits.abs().amax(dim=1)).max().item()
    print(f"max relative logits error over {N_NEW} steps: {rel:.2e}")
    assert rel <= 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_text_checkpoints_match_transformers(name, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    model = make_text_checkpoint(ckpt, name)
    check_against_hf(model, ckpt, tmp_path)


def test_fp8_release_matches_transformers(tmp_path):
    """A Qwen3.5 checkpoint in the FP8 releases' format (e4m3 projections, bf16 block scales): transformers
    dequantizes it on this GPU-less machine, and Kestrel's plan built from the same folder matches it."""
    ckpt = str(tmp_path / "ckpt")
    make_text_checkpoint(ckpt, "base")
    values = make_fp8_release(ckpt, block=(32, 16))  # blocks of 32 rows by 16 columns
    model = load_fp8_release(ckpt, "Qwen3_5ForCausalLM")
    name = "model.layers.3.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[name], values[name])
    check_against_hf(model, ckpt, tmp_path)


def test_multimodal_layout_matches_transformers(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    model = make_multimodal_checkpoint(ckpt)
    notes = []
    build(ckpt, str(tmp_path / "mm.plan"), max_seq=64, log=notes.append, progress=False)
    assert any("vision tower" in n for n in notes) and any("multi-token-prediction" in n for n in notes)
    check_against_hf(model, ckpt, tmp_path)


@pytest.mark.parametrize("rows", [0, 3, 7])
def test_prefill_rows_match_transformers(rows, tmp_path):
    """The 7-token prompt one token a step (0), in M-row chunks of 3 (3 + 3 + 1: more than one chunk,
    not a multiple) and in one chunk of exactly 7 rows."""
    name = sorted(CONFIGS)[0]
    ckpt = str(tmp_path / "ckpt")
    model = make_text_checkpoint(ckpt, name)
    check_against_hf(model, ckpt, tmp_path, prefill_rows=rows)
