"""Kestrel's CPU reference path (fp32) against transformers' Qwen3-Next (qwen3_next: Gated DeltaNet +
gated attention + sparse mixture-of-experts MLPs) on checkpoints it saved itself: the same greedy
tokens for 32 steps and every step's logits within 1e-4 relative (test_oracle.py's measure)."""
import pytest

from hf_checkpoints import NEXT_CONFIGS, make_next_checkpoint
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
