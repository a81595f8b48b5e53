"""Built-in models: ``tiny``, a seeded Qwen3.5-architecture checkpoint synthesized on the spot,
``tiny-mtp``, the same with a multi-token-prediction head (``mtp.*``, for ``--speculative mtp``), their
Qwen3-Next counterparts ``tiny-next`` and ``tiny-next-mtp``, and ``tiny-moe`` / ``tiny-moe-mtp``, the Qwen3.5 MoE
layout.

``tiny`` is written in the same Hugging Face format a downloaded checkpoint has (config.json,
model.safetensors, tokenizer.json) and then compiled through the ordinary frontend, so the preset
exercises exactly the path a real checkpoint takes. It has both layer kinds, more value heads than
key heads in the Gated DeltaNet layers, GQA in attention, and untied embeddings. Weights come from
numpy's PCG64 generator with a fixed seed, so every build of ``tiny`` is byte-identical.

Presets use a byte-level tokenizer (ids 0-255 are the bytes, 256 is ``<|endoftext|>``), built with
the tokenizers library and stored as a regular tokenizer.json.
"""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kestrel.compiler.frontend import expected_tensors, mtp_expected_tensors, mtp_layers_in, parse_config

TINY_SEED = 20261129
EOS_TEXT = "<|endoftext|>"

PRESETS: dict[str, dict] = {
    "tiny": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "eos_token_id": 256,
        "bos_token_id": None,
        "dtype": "float32",
    }
}
# ``tiny`` with a multi-token-prediction head (random, like the rest): what ``--speculative mtp`` drafts with
PRESETS["tiny-mtp"] = dict(PRESETS["tiny"], mtp_num_hidden_layers=1)
# Qwen3-Next at tiny size: the same layers as ``tiny`` with fused GDN projections and a sparse MoE MLP in
# every layer (8 experts of 64, top 2, renormalised; a shared expert of 96, so three q4 groups: 128 / 64 / 32)
PRESETS["tiny-next"] = dict(PRESETS["tiny"], architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[])
# ``tiny-next`` with a multi-token-prediction head (random): its layer is full attention with the sparse MoE MLP
PRESETS["tiny-next-mtp"] = dict(PRESETS["tiny-next"], mtp_num_hidden_layers=1)
# Qwen3.5 MoE (model_type qwen3_5_moe_text) at tiny size: ``tiny``'s layers (unfused GDN projections) with the
# sparse MoE block of ``tiny-next`` in every layer and no dense MLP (no intermediate_size); the router always
# renormalises
PRESETS["tiny-moe"] = dict({k: v for k, v in PRESETS["tiny"].items() if k != "intermediate_size"},
                           architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)
# ``tiny-moe`` with a multi-token-prediction head (random): its layer full attention with the sparse MoE MLP
PRESETS["tiny-moe-mtp"] = dict(PRESETS["tiny-moe"], mtp_num_hidden_layers=1)


def _qwen35(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, gdn_value_heads: int, tied: bool) -> dict:
    """A published Qwen3.5 dense text model's shape. Shared by all sizes: head_dim 256, 16 GDN key
    heads, GDN head dims 128, conv kernel 4, a full-attention layer every 4th, vocab 248320, RoPE
    theta 1e7 on a quarter of the head dims, eps 1e-6, 262144 positions, eos 248044, one MTP layer
    (read only by ``--speculative mtp``)."""
    return dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden, intermediate_size=mlp,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=gdn_value_heads, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=tied,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                rms_norm_eps=1e-6, max_position_embeddings=262144, eos_token_id=248044, mtp_num_hidden_layers=1)


# The published Qwen3.5 text-model shapes (no weights), for kernels at real shapes and for benchmarking
# with --weights random. 0.8B and 27B as in DESIGN.md; 2B, 4B and 9B from copies of their
# config.json text_config and training-framework shape scripts, agreeing across sources.
QWEN35_SHAPES: dict[str, dict] = {
    "qwen3.5-0.8b": _qwen35(1024, 3584, 24, 8, 2, 16, tied=True),
    "qwen3.5-2b": _qwen35(2048, 6144, 24, 8, 2, 16, tied=True),
    "qwen3.5-4b": _qwen35(2560, 9216, 32, 16, 4, 32, tied=True),
    "qwen3.5-9b": _qwen35(4096, 12288, 32, 16, 4, 32, tied=False),
    "qwen3.5-27b": _qwen35(5120, 17408, 64, 24, 4, 48, tied=False),
}


# Qwen3-Next-80B-A3B (model_type qwen3_next), its published config.json: 48 layers (36 GDN + 12 attention),
# hidden 2048, attention 16 / 2 heads of 256 with RoPE theta 1e7 on a quarter of the dims, GDN 16 key / 32
# value heads of 128, every layer's MLP a sparse MoE block of 512 experts of 512, top 10 renormalised, a
# shared expert of 512; vocab 151936, untied, 262144 positions, eos 151645, one MTP layer (read only by
# ``--speculative mtp``: full attention and the same MoE block). ~80B parameters, ~3B active.
QWEN3_NEXT_SHAPES: dict[str, dict] = {
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                "partial_rotary_factor": 0.25},
                               rms_norm_eps=1e-6, max_position_embeddings=262144, eos_token_id=151645,
                               num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                               mlp_only_layers=[], full_attention_interval=4, mtp_num_hidden_layers=1),
}
# Qwen3.5-35B-A3B (model_type qwen3_5_moe; its text model): Qwen3.5's shared settings (``_qwen35``: head_dim 256,
# GDN 16 key heads of 128, RoPE theta 1e7 on a quarter of the dims, 262144 positions, vocab 248320, one MTP
# layer) with hidden 2048, 40 layers (30 GDN + 10 attention), attention 16 / 2 heads, GDN 32 value heads, and in
# every layer a sparse MoE block of 256 experts of 512, top 8 renormalised, a shared expert of 512; untied.
# transformers' Qwen3_5MoeTextConfig defaults (documented as this model's shape) and a training framework's shape
# script agree on these; not checked against the released config.json. ~35B parameters, ~3B active.
QWEN35_MOE_SHAPES: dict[str, dict] = {
    "qwen3.5-35b-a3b": dict({k: v for k, v in _qwen35(2048, 0, 40, 16, 2, 32, tied=False).items()
                             if k != "intermediate_size"},
                            model_type="qwen3_5_moe_text", num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512),
}
SHAPES: dict[str, dict] = QWEN35_SHAPES | QWEN3_NEXT_SHAPES | QWEN35_MOE_SHAPES  # the shapes-only presets


def byte_level_tokenizer_json() -> str:
    """A byte-level tokenizer: one token per byte (id = byte value) plus <|endoftext|> (id 256)."""

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    # GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer and decoder use
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True)])
    return tok.to_str()


def random_weights(shapes: dict[str, tuple], seed: int) -> dict[str, np.ndarray]:
    """Weights with the spread of a trained model (so greedy decoding is decisive), from one seed.

    Matrices ~ N(0, 1/fan_in); embeddings ~ N(0, 1); zero-centred norms ~ N(0, 0.1); the gated
    norm ~ 1 + N(0, 0.1); A_log = log U(1, 16); dt_bias ~ N(0, 0.5); conv taps ~ N(0, 0.5).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias") or "conv1d" in name:
            w = rng.normal(0.0, 0.5, shape)
        elif name.endswith("linear_attn.norm.weight"):
            w = 1.0 + rng.normal(0.0, 0.1, shape)
        elif len(shape) == 1:
            w = rng.normal(0.0, 0.1, shape)
        elif "embed_tokens" in name:
            w = rng.normal(0.0, 1.0, shape)
        else:
            w = rng.normal(0.0, shape[-1] ** -0.5, shape)
        out[name] = w.astype(np.float32)
    return out


def synthesize(name: str, folder: str) -> str:
    """Write preset ``name`` as a Hugging Face checkpoint into ``folder``; returns the folder."""


    raw = PRESETS[name]
    cfg = parse_config(raw, f"preset {name}")
    shapes = {"model." + rel: shape for rel, shape in expected_tensors(cfg)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if mtp_layers_in(raw):  # drawn after the text model's, which therefore do not depend on it
        shapes.update(mtp_expected_tensors(cfg))
    os.makedirs(folder, exist_ok=True)
    save_file(random_weights(shapes, TINY_SEED), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(byte_level_tokenizer_json())
    return folder
