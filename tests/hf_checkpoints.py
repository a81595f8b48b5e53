"""Small Qwen3.5 checkpoints made by transformers itself (the oracle), saved with save_pretrained.

Weights are re-drawn with the spread of a trained model (``presets.random_weights``): the library's
own init (std 0.02, zero norms) makes nearly flat logits, where greedy tokens would hinge on noise.
"""
from __future__ import annotations

import os

import torch

from kestrel.compiler.presets import random_weights

BASE = dict(vocab_size=192, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)

# name -> (text config overrides, save options)
CONFIGS = {
    "base": ({}, {}),
    "tied_wide": (dict(hidden_size=96, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                       linear_num_key_heads=3, linear_num_value_heads=6, linear_value_head_dim=32,
                       tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                  "partial_rotary_factor": 0.5}), {}),
    "mha_sharded": (dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=16, layer_types=["linear_attention", "full_attention",
                                                                "linear_attention", "full_attention"]),
                    {"max_shard_size": "40KB"}),
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    sd = model.state_dict()
    fresh = random_weights({k: tuple(v.shape) for k, v in sd.items()}, seed)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in fresh.items()})


def make_text_checkpoint(folder: str, name: str, seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    overrides, save_opts = CONFIGS[name]
    cfg = Qwen3_5TextConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).eval()
    _redraw(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(folder, **save_opts)
    return model


def make_multimodal_checkpoint(folder: str, seed: int = 0):
    """Laid out as Qwen3.5 releases are: Qwen3_5ForConditionalGeneration (model.language_model.*,
    model.visual.*) plus an MTP head (mtp.*) that Kestrel must skip."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=BASE["hidden_size"],
                  patch_size=4, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=dict(BASE), vision_config=vision)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    _redraw(model, seed)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["mtp.fc.weight"] = torch.zeros(BASE["hidden_size"], 2 * BASE["hidden_size"])
    save_file(tensors, path, metadata={"format": "pt"})
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy decode (its KV / recurrent cache path): tokens and per-step logits."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([l[0] for l in out.logits]).float()
