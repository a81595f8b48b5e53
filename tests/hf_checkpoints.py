"""Small Qwen3.5 checkpoints made by transformers itself (the oracle), saved with save_pretrained.

Weights are re-drawn with the spread of a trained model (``presets.random_weights``): the library's
own init (std 0.02, zero norms) makes nearly flat logits, where greedy tokens would hinge on noise.
"""
from __future__ import annotations

import json
import os

import safetensors.numpy
import safetensors.torch
import torch

from kestrel.compiler.presets import PRESETS, random_weights

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
    # YaRN over a quarter of the head (theta 1e4, original 4096: the ramp over frequency indices 1.31 .. 2.81, so
    # index 2 blends, 0-1 extrapolate, 3 interpolates), cos and sin scaled by 0.1 ln 4 + 1
    "yarn": (dict(max_position_embeddings=16384,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False}), {}),
    "mha_sharded": (dict(hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
                         head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=16, layer_types=["linear_attention", "full_attention",
                                                                "linear_attention", "full_attention"]),
                    {"max_shard_size": "40KB"}),
}


# Qwen3-Next (model_type qwen3_next, MoE): name -> (config overrides on NEXT_BASE, save options). Different
# expert counts and top-k, norm_topk_prob on and off, a dense layer among the sparse ones (mlp_only_layers),
# decoder_sparse_step 2, odd layer counts, widths of the shared expert unlike the routed ones, a sharded save.
NEXT_BASE = dict(BASE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1)
NEXT_CONFIGS = {
    "e8k2": ({}, {}),
    "e16k4_nonorm_odd": (dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, num_hidden_layers=5,
                              moe_intermediate_size=64, shared_expert_intermediate_size=32, mlp_only_layers=[1]), {}),
    # YaRN on the whole head (the ramp over indices 2 .. 6: 3-5 blend), its factor from max_position_embeddings
    "e8k2_yarn": (dict(max_position_embeddings=8192,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                        "factor": None, "original_max_position_embeddings": 4096}), {}),
    "e6k3_step2_sharded": (dict(num_experts=6, num_experts_per_tok=3, num_hidden_layers=7, decoder_sparse_step=2,
                                linear_num_value_heads=8, hidden_size=96, num_attention_heads=6,
                                num_key_value_heads=2), {"max_shard_size": "60KB"}),
}


def make_next_checkpoint(folder: str, name: str, seed: int = 0):
    """A Qwen3-Next checkpoint saved by transformers' Qwen3NextForCausalLM (experts one tensor each, as
    save_pretrained writes them and the released checkpoints store them)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    overrides, save_opts = NEXT_CONFIGS[name]
    cfg = Qwen3NextConfig(**{**NEXT_BASE, **overrides})
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).eval()
    _redraw(model, seed)
    model.save_pretrained(folder, **save_opts)
    return model


# Qwen3.5 MoE (model_type qwen3_5_moe_text, or the multimodal qwen3_5_moe): Qwen3.5's layers (unfused GDN projections)
# with Qwen3-Next's sparse MoE block in every layer, the router always renormalising. name -> (config overrides on
# QWEN35_MOE_BASE, save options, experts stored fused as transformers holds them, the multimodal wrapper).
QWEN35_MOE_BASE = {k: v for k, v in BASE.items() if k != "intermediate_size"} | dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
QWEN35_MOE_CONFIGS = {
    "e8k2": ({}, {}, False, False),
    "e16k4_fused_odd": (dict(num_experts=16, num_experts_per_tok=4, num_hidden_layers=5, moe_intermediate_size=64,
                             shared_expert_intermediate_size=32), {}, True, False),
    "e6k3_multimodal_sharded": (dict(num_experts=6, num_experts_per_tok=3, linear_num_value_heads=8, hidden_size=96,
                                     num_attention_heads=6, num_key_value_heads=2), {"max_shard_size": "60KB"},
                                False, True),
}


def make_qwen35_moe_checkpoint(folder: str, name: str, seed: int = 0):
    """A Qwen3.5 MoE checkpoint saved by transformers (Qwen3_5MoeForCausalLM, or Qwen3_5MoeForConditionalGeneration
    with a vision tower): save_pretrained writes the experts one tensor each; the fused configurations then store
    them as transformers holds them in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
    import transformers
    from safetensors.torch import load_file, save_file

    overrides, save_opts, fused, wrapper = QWEN35_MOE_CONFIGS[name]
    text = {**QWEN35_MOE_BASE, **overrides}
    torch.manual_seed(seed)
    if wrapper:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=4, num_position_embeddings=16)
        cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text)).eval()
    _redraw(model, seed)
    model.save_pretrained(folder, **save_opts)
    if fused:
        path = os.path.join(folder, "model.safetensors")
        t = load_file(path)
        for layer in range(text["num_hidden_layers"]):
            p = f"model.layers.{layer}.mlp.experts."
            n = text["num_experts"]
            gate_up = [torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")])
                       for e in range(n)]
            t[p + "gate_up_proj"] = torch.stack(gate_up)
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
        save_file(t, path, metadata={"format": "pt"})
    return model


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


# The matrices an FP8 release stores in e4m3 (Qwen's modules_to_not_convert keep the rest: embeddings, lm_head,
# norms, the router, the shared expert's gate, the conv taps, the GDN's b / a projections, A_log, dt_bias).
FP8_KEPT = ("in_proj_ba.weight", "in_proj_a.weight", "in_proj_b.weight")


def make_fp8_release(folder: str, block=(16, 16), scale_dtype=torch.bfloat16) -> dict:
    """Turn the checkpoint in ``folder`` (a single model.safetensors) into a fine-grained FP8 release as Qwen
    ships them: every projection matrix (``*proj*.weight``) under the layers (and the MTP head) as float8 e4m3
    codes with ``*.weight_scale_inv`` [ceil(N / bm), ceil(K / bn)] scales (amax / 448 per block), the
    quantization_config in config.json. Returns {name: the dequantized fp32 matrix} (what a reader must get)."""
    import json
    import math

    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors, values = load_file(path), {}
    bm, bn = block
    for name in [n for n in tensors if n.endswith(".weight") and "proj" in n.split(".")[-2]
                 and not n.endswith(FP8_KEPT) and tensors[n].dim() == 2]:
        w = tensors[name].float()
        n, k = w.shape
        padded = torch.zeros(math.ceil(n / bm) * bm, math.ceil(k / bn) * bn)
        padded[:n, :k] = w
        blocks = padded.reshape(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-8).to(scale_dtype)
        full = scale.float().repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:n, :k]
        codes = (w / full).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = codes, scale
        values[name] = codes.float() * full
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [bm, bn]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return values


def load_fp8_release(folder: str, cls_name: str):
    """transformers' own reading of an FP8 release on a machine without a GPU: it dequantizes every e4m3 matrix
    by its block scales (integrations/finegrained_fp8.py Fp8Dequantize), here into fp32 parameters."""
    import transformers

    return getattr(transformers, cls_name).from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy decode (its KV / recurrent cache path): tokens and per-step logits."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([l[0] for l in out.logits]).float()


def add_mtp_head(folder: str, seed: int = 1, tensors: dict | None = None) -> dict:
    """Give the checkpoint in ``folder`` (a single model.safetensors) an MTP head as Qwen3.5 releases
    ship one: ``mtp.*`` tensors (random, with the spread of ``random_weights``, unless ``tensors`` gives
    them by name) and ``mtp_num_hidden_layers`` 1 in config.json. Returns the head's tensors."""
    import json

    from safetensors.torch import load_file, save_file

    from kestrel.compiler.frontend import mtp_expected_tensors, read_config

    cfg = read_config(folder)[1]
    shapes = dict(mtp_expected_tensors(cfg))
    head = tensors or {k: torch.from_numpy(v) for k, v in random_weights(shapes, seed).items()}
    path = os.path.join(folder, "model.safetensors")
    saved = load_file(path)
    saved.update({k: v.contiguous().float() for k, v in head.items()})
    save_file(saved, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    (raw.get("text_config") if raw.get("model_type") == "qwen3_5" else raw)["mtp_num_hidden_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return head


GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
HELD_OUT = os.path.join(GOLDEN, "plan_memory", "tied_two_layers_q4.in.ir")
TRAINED_DIR = os.path.join(GOLDEN, "trained")


def train_byte_model(folder: str, config: dict, steps: int = 250, seed: int = 0):
    """A Qwen3.5 model trained by transformers for a few CPU steps, as a byte-level LM on Kestrel's
    golden IR input files (structured text it learns fast: loss ~0.4 nats/byte; the inputs change
    only when the lowering does, unlike launch-annotated outputs), so that its predictions
    are confident the way a trained LLM's are. Random weights are not: their top-1 margins sit
    below 4-bit noise, and quantisation agreement on them measures nothing. ``HELD_OUT`` is kept
    out of training for evaluation."""
    import glob

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    files = [f for f in sorted(glob.glob(os.path.join(GOLDEN, "*", "*.in.ir"))) if f != HELD_OUT]
    data = torch.tensor(list(b"".join(open(f, "rb").read() for f in files)))
    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(**config)
    model = Qwen3_5ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(data) - 65, (16,), generator=gen)
        batch = torch.stack([data[i:i + 65] for i in idx])
        model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval().to(torch.bfloat16).save_pretrained(folder)
    return model


# The byte models test_numerics evaluates (train_byte_model; trained_folder), by name: the tiny preset's architecture
# and a transformers config of other shapes.
TRAINED = {"tiny": {k: v for k, v in PRESETS["tiny"].items() if k not in ("architectures", "model_type", "dtype")},
           "transformers_base": dict(BASE, vocab_size=256)}


def trained_folder(name: str) -> str:
    """tests/golden/trained/<name>: TRAINED[name] trained by ``train_byte_model`` and saved in bf16 (as released
    checkpoints are), committed so that the suite does not spend ~2.5 CPU-minutes training them on every run.
    ``KESTREL_UPDATE_GOLDEN=1`` trains them again and rewrites the folder (then review the numerics tests' figures).
    A TRAINED config that no longer matches the saved one fails here, naming the update flag."""
    folder = os.path.join(TRAINED_DIR, name)
    if os.environ.get("KESTREL_UPDATE_GOLDEN") == "1":
        train_byte_model(folder, TRAINED[name])
    saved = json.load(open(os.path.join(folder, "config.json")))
    stale = sorted(k for k, v in TRAINED[name].items() if saved.get(k) != v)
    assert not stale, (f"tests/golden/trained/{name} was trained with other {stale}: rerun with "
                       "KESTREL_UPDATE_GOLDEN=1 to train it again")
    return folder


def edit_config(folder: str, fn) -> None:
    """``fn(config)`` on the checkpoint's config.json (a dict), written back."""
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    fn(cfg)
    json.dump(cfg, open(path, "w"))


def edit_tensors(folder: str, fn, framework: str = "np") -> None:
    """``fn(tensors)`` on a one-file checkpoint's tensors (a dict of numpy arrays, or of torch tensors with
    ``framework="pt"``: the dtypes numpy lacks, bf16 and FP8), written back."""
    lib = safetensors.torch if framework == "pt" else safetensors.numpy
    path = os.path.join(folder, "model.safetensors")
    t = lib.load_file(path)
    fn(t)
    lib.save_file(t, path)
