"""Frontend: read a Hugging Face Qwen3.5 / Qwen3-Next checkpoint folder, validate it all, open tensors lazily.

Accepted: ``config.json`` with model_type ``qwen3_5_text`` (text model; weights under ``model.*``),
``qwen3_next``, ``qwen3_5_moe_text`` (Qwen3.5's MoE models), or the multimodal wrappers ``qwen3_5`` /
``qwen3_5_moe`` (text settings under ``text_config``, weights under ``model.language_model.*``; vision tower
and MTP head are skipped with a one-line notice); a Hugging Face repository id is found in the local cache
(``find_checkpoint``); and the weights as ``model.safetensors`` or shards listed in
``model.safetensors.index.json``, unquantized or as an FP8 release (compiler/fp8_checkpoint.py: its e4m3 matrices
are dequantized by their block scales as read), a MoE model's experts one tensor each or fused. With
``mtp=True`` (``kestrelc build --speculative mtp``) the multi-token-prediction head (``mtp.*``: the
drafter of speculative decoding, ``mtp_expected_tensors``) is read and validated like the text model;
a checkpoint without one is refused with NoDraftHeadError.

Everything is checked before any work starts (``open_checkpoint``): the config's keys and their
consistency, then every expected tensor's presence, shape and dtype, and that no unknown tensor is
left over. A problem raises ConfigError / CheckpointError with one line naming the key or tensor.
Tensors are then read one at a time (``Checkpoint.read``), so peak memory does not grow with the
checkpoint's size.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from safetensors import SafetensorError, safe_open

from kestrel.artifacts.errors import CheckpointError, ConfigError, NoDraftHeadError, UnsupportedError
from kestrel.compiler.fp8_checkpoint import (FP8_DTYPE, SCALE_DTYPES, SCALE_SUFFIX, Fp8Blocks, dequantize,
                                             parse_quantization)

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
# the multimodal wrappers: text settings under text_config, the text model's weights under model.language_model.*
WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# Qwen3.5's mixture-of-experts models (Qwen3.5-35B-A3B and larger): Qwen3.5's layers (unfused GDN projections) with
# Qwen3-Next's sparse MoE block in every layer, its router always renormalising the top-k weights
QWEN35_MOE_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
CHECKPOINT_DTYPES = ("F32", "BF16", "F16")
# Parts of a multimodal checkpoint the text step does not use.
MTP_PREFIX = "mtp."
SKIPPED_PREFIXES = {"model.visual.": "vision tower", MTP_PREFIX: "multi-token-prediction head"}


def _skipped_part(name: str, mtp: bool) -> str | None:
    """The part of the checkpoint a tensor belongs to that the build skips (SKIPPED_PREFIXES; the MTP head is read
    when ``mtp``), or None."""
    return next((what for p, what in SKIPPED_PREFIXES.items() if name.startswith(p) and not (mtp and p == MTP_PREFIX)),
                None)


@dataclass(frozen=True)
class ModelConfig:
    """The normalised text-model settings the compiler needs (nothing model-type specific)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    linear_conv_kernel_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = field(default=())
    # Qwen3-Next (model_type qwen3_next): fused GDN projections and mixture-of-experts MLPs. mlp_types[i] is
    # "moe" or "dense" per layer (empty: every layer dense, as in Qwen3.5); the rest only matter with "moe".
    mlp_types: tuple[str, ...] = field(default=())
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # YaRN (rope_type "yarn"): (factor, ramp low, ramp high - low, attention factor), what every RoPE kernel
    # takes (kernels/attention.py rope_inv_freq); empty: plain RoPE. rope_max_positions: the positions YaRN
    # extends the model to (factor x original_max_position_embeddings), 0 without it.
    rope_yarn: tuple[float, ...] = field(default=())
    rope_max_positions: int = 0

    @property
    def fused_gdn_projections(self) -> bool:
        """in_proj_qkvz / in_proj_ba (interleaved per key-head group) instead of in_proj_qkv/z/b/a."""
        return self.model_type == "qwen3_next"

    def mlp_type(self, layer: int) -> str:
        return self.mlp_types[layer] if self.mlp_types else "dense"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_positions(self) -> int:
        """The longest sequence the model's positions cover: max_position_embeddings, or what YaRN extends it to."""
        return self.rope_max_positions or self.max_position_embeddings

    @property
    def rope_attrs(self) -> dict:
        """The RoPE attributes of the IR's rope-bearing ops: theta and rotary_dim, and ``yarn`` with YaRN."""
        return {"theta": self.rope_theta, "rotary_dim": self.rotary_dim,
                **({"yarn": list(self.rope_yarn)} if self.rope_yarn else {})}

    @property
    def gdn_conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.rope_yarn:
            d["rope_yarn"] = list(self.rope_yarn)
        else:  # a plain-RoPE model's normalised config is what it was before YaRN existed
            for k in ROPE_FIELDS:
                d.pop(k)
        if not self.mlp_types:  # a dense model's normalised config is what it was before MoE existed
            for k in MOE_FIELDS:
                d.pop(k)
        else:
            d["mlp_types"] = list(self.mlp_types)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["mlp_types"] = tuple(d.get("mlp_types", ()))
        d["rope_yarn"] = tuple(d.get("rope_yarn", ()))
        return cls(**d)


ROPE_FIELDS = ("rope_yarn", "rope_max_positions")
MOE_FIELDS = ("mlp_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob")


def _get(cfg: dict, key: str, kind, where: str, default=None, positive=True):
    if key not in cfg or cfg[key] is None:
        if default is not None:
            return default
        raise ConfigError(f"{where}: missing key {key!r}")
    v = cfg[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"{where}: {key!r} must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ConfigError(f"{where}: {key!r} must be a number, got {v!r}")
    if kind is bool and not isinstance(v, bool):
        raise ConfigError(f"{where}: {key!r} must be true or false, got {v!r}")
    if positive and kind in (int, float) and v <= 0:
        raise ConfigError(f"{where}: {key!r} must be positive, got {v!r}")
    return kind(v)


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Normalise and validate a Qwen3.5 config.json (text or multimodal wrapper)."""
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: unknown model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    text = raw
    if mt in WRAPPER_MODEL_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: model_type {mt!r} needs a 'text_config' table")
        where = f"{where} text_config"
    g = lambda k, kind=int, **kw: _get(text, k, kind, where, **kw)  # noqa: E731

    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {text['hidden_act']!r} is not supported (expected 'silu')")
    if text.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3.5 has no attention bias)")

    n_layers = g("num_hidden_layers")
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = g("full_attention_interval", default=4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(f"{where}: 'layer_types' must list {n_layers} entries (num_hidden_layers)")
    bad = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise ConfigError(f"{where}: 'layer_types' has unknown kinds {bad}; expected linear_attention / full_attention")

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: 'rope_parameters' must be a table")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (expected 'default' or 'yarn')")
    rope_src = rope if "rope_theta" in rope else text
    theta = _get(rope_src, "rope_theta", float, where, default=10000.0)
    prf_src = rope if "partial_rotary_factor" in rope else text
    prf = _get(prf_src, "partial_rotary_factor", float, where, default=0.25)

    heads, kv_heads = g("num_attention_heads"), g("num_key_value_heads")
    hidden = g("hidden_size")
    head_dim = g("head_dim", default=hidden // heads)
    lk, lv = g("linear_num_key_heads"), g("linear_num_value_heads")
    tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigError(f"{where}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])

    moe = {}
    if mt == "qwen3_next":
        moe = _parse_moe(text, g, n_layers, where)
    elif mt in QWEN35_MOE_TYPES:
        moe = _parse_moe(text, g, n_layers, where, every_layer=True)
    # a Qwen3.5 MoE model has no dense MLP: its config has no intermediate_size (transformers deletes one)
    intermediate = 0 if mt in QWEN35_MOE_TYPES else g("intermediate_size")
    cfg = ModelConfig(
        model_type=mt, vocab_size=g("vocab_size"), hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=n_layers, layer_types=tuple(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=theta, partial_rotary_factor=prf, rms_norm_eps=g("rms_norm_eps", float, default=1e-6),
        linear_conv_kernel_dim=g("linear_conv_kernel_dim", default=4),
        linear_num_key_heads=lk, linear_num_value_heads=lv,
        linear_key_head_dim=g("linear_key_head_dim"), linear_value_head_dim=g("linear_value_head_dim"),
        tie_word_embeddings=tie, max_position_embeddings=g("max_position_embeddings"),
        eos_token_ids=eos_ids, **moe,
        **(_parse_yarn(rope, text, theta, int(head_dim * prf), g("max_position_embeddings"), where)
           if rope_type == "yarn" else {}),
    )
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
    if lv % lk:
        raise ConfigError(f"{where}: linear_num_value_heads {lv} must be a multiple of linear_num_key_heads {lk}")
    if not (0 < prf <= 1) or cfg.rotary_dim % 2 or cfg.rotary_dim == 0:
        raise ConfigError(f"{where}: head_dim {head_dim} x partial_rotary_factor {prf} must give an even rotary dim > 0")
    return cfg


def _parse_yarn(rope: dict, text: dict, theta: float, dim: int, max_pos: int, where: str) -> dict:
    """YaRN's RoPE settings (ModelConfig.rope_yarn), computed as transformers' ``_compute_yarn_parameters``
    computes them (modeling_rope_utils; the rotary embedding scales cos and sin by the attention factor):
    ``original_max_position_embeddings`` from the table, else the config's top level (as Phi-3 keeps it), else
    max_position_embeddings; ``factor`` None or absent: max_position_embeddings / original; the attention factor
    given, or 0.1 ln(factor) + 1 (the ratio of two such with ``mscale`` and ``mscale_all_dim``); the ramp between
    the dims that turn ``beta_fast`` (32) and ``beta_slow`` (1) times over the original length, floored and
    ceiled unless ``truncate`` is false, clamped into 0 .. dim - 1, widened by 0.001 where its ends meet."""
    def num(key, default=None):
        return _get(rope, key, float, f"{where} rope_parameters", default=default)

    if theta <= 1:
        raise ConfigError(f"{where}: YaRN needs rope_theta > 1, got {theta!r}")

    original = rope.get("original_max_position_embeddings", text.get("original_max_position_embeddings", max_pos))
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{where}: YaRN's original_max_position_embeddings must be a positive integer, "
                          f"got {original!r}")
    factor = num("factor", default=max_pos / original)
    if factor < 1:
        raise ConfigError(f"{where}: YaRN's factor must be at least 1, got {factor!r}")

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is not None:
        attention = num("attention_factor")
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = mscale(factor, num("mscale")) / mscale(factor, num("mscale_all_dim"))
    else:
        attention = mscale(factor)
    beta_fast, beta_slow = num("beta_fast", default=32.0), num("beta_slow", default=1.0)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: YaRN's truncate must be true or false, got {truncate!r}")

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    return {"rope_yarn": (float(factor), float(low), float(high - low), float(attention)),
            "rope_max_positions": int(factor * original)}


def _parse_moe(text: dict, g, n_layers: int, where: str, every_layer: bool = False) -> dict:
    """The MoE MLP settings. Qwen3-Next (transformers' Qwen3NextDecoderLayer): layer i is a sparse MoE block iff
    i is not in ``mlp_only_layers``, num_experts > 0 and (i + 1) % decoder_sparse_step == 0; otherwise a
    dense MLP of ``intermediate_size``. Qwen3.5 MoE (``every_layer``; Qwen3_5MoeDecoderLayer): every layer is
    a sparse MoE block and the router always renormalises (Qwen3_5MoeTopKRouter; its config has no
    mlp_only_layers, decoder_sparse_step or norm_topk_prob, and transformers ignores them)."""
    n_exp = g("num_experts", positive=every_layer, default=256 if every_layer else 512)
    if every_layer:
        types, norm = ("moe",) * n_layers, True
    else:
        step = g("decoder_sparse_step", default=1)
        only = text.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ConfigError(f"{where}: 'mlp_only_layers' must be a list of layer indices")
        types = tuple("moe" if (i not in only and n_exp > 0 and (i + 1) % step == 0) else "dense"
                      for i in range(n_layers))
        norm = text.get("norm_topk_prob", True)
        if not isinstance(norm, bool):
            raise ConfigError(f"{where}: 'norm_topk_prob' must be true or false, got {norm!r}")
    if "moe" not in types:
        return {"mlp_types": types}
    k = g("num_experts_per_tok", default=10 if not every_layer else 8)
    if k > n_exp:
        raise ConfigError(f"{where}: num_experts_per_tok {k} is more than num_experts {n_exp}")
    return {"mlp_types": types, "num_experts": n_exp, "num_experts_per_tok": k,
            "moe_intermediate_size": g("moe_intermediate_size", default=512),
            "shared_expert_intermediate_size": g("shared_expert_intermediate_size", default=512),
            "norm_topk_prob": norm}


# ORG/NAME or ORG/NAME@REVISION: a Hugging Face model repository (no "--" or ".." in a name, none in a revision)
HF_REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w/-][\w./-]*)?")


def find_checkpoint(model: str) -> tuple[str, dict | None]:
    """(folder, None) for a path; for a Hugging Face repository id that is not a path (``Qwen/Qwen3.5-27B``,
    ``ORG/NAME@REVISION``), (its snapshot folder in the local Hugging Face cache, {"repo", "revision"}). Nothing
    is downloaded: a build never fetches tens of gigabytes on its own; `hf download` does, once."""
    if os.path.exists(model) or not HF_REPO_ID.fullmatch(model):
        return model, None
    repo, _, revision = model.partition("@")
    try:
        folder = snapshot_download(repo, revision=revision or None, local_files_only=True)
    except HFValidationError:
        raise ConfigError(f"{model}: no such checkpoint folder (or preset name)") from None
    except LocalEntryNotFoundError:
        raise ConfigError(f"{model}: no such checkpoint folder (or preset name), and not in the Hugging Face cache "
                          f"({hub_constants.HF_HUB_CACHE}); download it first (hf download {repo}"
                          f"{' --revision ' + revision if revision else ''}) or give its folder") from None
    return folder, {"repo": repo, "revision": os.path.basename(os.path.normpath(folder))}


def read_config(folder: str) -> tuple[dict, ModelConfig]:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ConfigError(f"{folder}: no such checkpoint folder (or preset name)")
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a folder, not a file; a checkpoint's config.json is a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{folder}: no config.json; is this a Hugging Face checkpoint folder?") from None
    except PermissionError:
        raise ConfigError(f"{path}: permission denied; make it readable (chmod +r)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; config.json must be a UTF-8 JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw, parse_config(raw, path)


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_chat_template(folder: str) -> dict:
    """The checkpoint's chat template and the special tokens it may refer to, as transformers finds
    them: ``chat_template.jinja`` if present, else tokenizer_config.json's ``chat_template`` (a string,
    or a list of named templates: ``default``). {} when there is none."""
    cfg_path, jinja_path = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "chat_template.jinja")
    tok_cfg = {}
    try:
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                tok_cfg = json.load(f)
        template = tok_cfg.get("chat_template") if isinstance(tok_cfg, dict) else None
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_path}: cannot be read as a tokenizer config ({e})") from None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str) or not template:
        return {}
    special = {}
    for name in SPECIAL_TOKENS:
        v = tok_cfg.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            special[name] = v
    return {"chat_template": template, "special_tokens": special}


# generation_config.json's sampling settings Kestrel takes: (key, kind, the values allowed, as text)
GENERATION_SAMPLING = (("temperature", float, lambda v: v >= 0, ">= 0"),
                       ("top_p", float, lambda v: 0 < v <= 1, "in (0, 1]"),
                       ("top_k", int, lambda v: v >= 0, ">= 0"), ("min_p", float, lambda v: 0 <= v <= 1, "in [0, 1]"))


def read_generation_config(folder: str) -> tuple[tuple[int, ...], dict]:
    """(stop tokens, recommended sampling) from the checkpoint's generation_config.json, ((), {}) without one.
    The stop tokens (``eos_token_id``: an id or a list) are what transformers' generate and vLLM stop at: Qwen's
    instruct releases list <|im_end|> there beside config.json's <|endoftext|>. The sampling settings
    (temperature, top_p, top_k, min_p; only with ``do_sample`` true, as generate reads them) are what vLLM uses
    for a request that sets none; kestrel-run likewise, for the options not given on its command line."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return (), {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as a generation config ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    eos = raw.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos if isinstance(eos, list) else None
    if eos is not None and (ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in ids)):
        raise ConfigError(f"{path}: 'eos_token_id' must be a token id or a list of them, got {eos!r}")
    sampling = {}
    if raw.get("do_sample") is True:
        for key, kind, ok, allowed in GENERATION_SAMPLING:
            v = raw.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)) \
                    or not ok(v):
                raise ConfigError(f"{path}: {key!r} must be {'an integer' if kind is int else 'a number'} {allowed}, "
                                  f"got {v!r}")
            sampling[key] = kind(v)
    return tuple(ids or ()), sampling


def expected_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name relative to the text model prefix, shape) of every tensor of the text model
    (``lm_head.weight``, which sits outside that prefix, is handled by the caller)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    out = [("embed_tokens.weight", (cfg.vocab_size, h)), ("norm.weight", (h,))]
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        out += mlp_expected_tensors(cfg, p, i)
        if kind == "linear_attention":
            a = p + "linear_attn."
            hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            if cfg.fused_gdn_projections:  # Qwen3-Next: interleaved per key-head group (gdn_projection_source)
                out += [(a + "in_proj_qkvz.weight", (cfg.gdn_conv_channels + hv * dv, h)),
                        (a + "in_proj_ba.weight", (2 * hv, h))]
            else:
                out += [(a + "in_proj_qkv.weight", (cfg.gdn_conv_channels, h)), (a + "in_proj_z.weight", (hv * dv, h)),
                        (a + "in_proj_b.weight", (hv, h)), (a + "in_proj_a.weight", (hv, h))]
            out += [(a + "conv1d.weight", (cfg.gdn_conv_channels, 1, cfg.linear_conv_kernel_dim)),
                    (a + "A_log", (hv,)), (a + "dt_bias", (hv,)), (a + "norm.weight", (dv,)),
                    (a + "out_proj.weight", (h, hv * dv))]
        else:
            a = p + "self_attn."
            nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
            out += [(a + "q_proj.weight", (nh * hd * 2, h)), (a + "k_proj.weight", (nkv * hd, h)),
                    (a + "v_proj.weight", (nkv * hd, h)), (a + "o_proj.weight", (h, nh * hd)),
                    (a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,))]
    return out


def mlp_expected_tensors(cfg: ModelConfig, p: str, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """The MLP tensors of the decoder layer at ``p`` (``layers.3.``, ``mtp.layers.0.``) whose MLP kind is
    layer index ``layer``'s (``ModelConfig.mlp_type``): a dense MLP of intermediate_size, or a sparse MoE
    block (``moe_expected_tensors``)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.mlp_type(layer) == "moe":
        return moe_expected_tensors(cfg, p + "mlp.")
    return [(p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]


def moe_expected_tensors(cfg: ModelConfig, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse MoE block's tensors (under ``p``, ``layers.N.mlp.``) as checkpoints store them (one tensor per expert
    and projection: transformers' save_pretrained writes them so, and the released Qwen3-Next checkpoints are
    so; experts stored fused instead are read as these names, ``Checkpoint._split_fused_experts``): the router
    ``mlp.gate`` [E, H], each expert's gate/up [I, H] and down [H, I], the shared expert's gate/up [Is, H] and
    down [H, Is], and ``mlp.shared_expert_gate`` [1, H]."""
    h, i, s = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = [(p + "gate.weight", (cfg.num_experts, h))]
    for e in range(cfg.num_experts):
        out += [(f"{p}experts.{e}.gate_proj.weight", (i, h)), (f"{p}experts.{e}.up_proj.weight", (i, h)),
                (f"{p}experts.{e}.down_proj.weight", (h, i))]
    out += [(p + "shared_expert.gate_proj.weight", (s, h)), (p + "shared_expert.up_proj.weight", (s, h)),
            (p + "shared_expert.down_proj.weight", (h, s)), (p + "shared_expert_gate.weight", (1, h))]
    return out


def mtp_layers_in(raw: dict) -> int | None:
    """``mtp_num_hidden_layers`` of a config.json (the text config of the multimodal wrapper), or None
    when it does not say."""
    text = raw.get("text_config") if raw.get("model_type") in WRAPPER_MODEL_TYPES else raw
    v = text.get("mtp_num_hidden_layers") if isinstance(text, dict) else None
    if v is None:
        v = raw.get("mtp_num_hidden_layers")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# The MTP layer's index for its MLP kind: vLLM builds it as a Qwen3NextDecoderLayer whose layer_idx is read from
# its prefix ``mtp.layers.0`` (extract_layer_index), so it is a sparse MoE block exactly when layer 0 of the
# model would be one (mlp_only_layers, decoder_sparse_step): in every released Qwen3-Next it is.
MTP_MLP_LAYER = 0


def mtp_expected_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor of the MTP head, as Qwen3.5 and Qwen3-Next releases
    name them (vLLM's qwen3_5_mtp.py / qwen3_next_mtp.py load the same names): the two pre-fc norms,
    ``fc`` joining [embedding | hidden] (``[H, 2H]``, embedding first), one full-attention decoder
    layer with the model's MLP (Qwen3-Next: the sparse MoE block, experts one tensor each as in the
    model's layers; ``MTP_MLP_LAYER``), and the final norm. Embedding table and lm_head are the model's."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    p = MTP_PREFIX + "layers.0."
    a = p + "self_attn."
    return [(MTP_PREFIX + "pre_fc_norm_embedding.weight", (h,)), (MTP_PREFIX + "pre_fc_norm_hidden.weight", (h,)),
            (MTP_PREFIX + "fc.weight", (h, 2 * h)),
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
            (a + "q_proj.weight", (nh * hd * 2, h)), (a + "k_proj.weight", (nkv * hd, h)),
            (a + "v_proj.weight", (nkv * hd, h)), (a + "o_proj.weight", (h, nh * hd)),
            (a + "q_norm.weight", (hd,)), (a + "k_norm.weight", (hd,))] + \
        mlp_expected_tensors(cfg, p, MTP_MLP_LAYER) + [(MTP_PREFIX + "norm.weight", (h,))]


class Checkpoint:
    """A validated checkpoint: ``tensors`` maps plan-relative names to (file, hf name, dtype, shape)."""

    def __init__(self, folder: str, cfg: ModelConfig, mtp: bool = False, mtp_layers: int | None = None,
                 fp8: Fp8Blocks | None = None):
        """``mtp``: the MTP head is read too (its tensors under their checkpoint names, ``mtp.*``);
        ``mtp_layers``: the config's ``mtp_num_hidden_layers`` (None: not given); ``fp8``: the block shape of
        an FP8 release (compiler/fp8_checkpoint.py), whose F8_E4M3 matrices are dequantized as they are read."""
        self.folder, self.cfg, self.fp8 = folder, cfg, fp8
        self.prefix = "model.language_model." if cfg.model_type in WRAPPER_MODEL_TYPES else "model."
        self.notices: list[str] = []
        self.scales: dict[str, tuple[str, str, str, tuple]] = {}  # FP8 matrix (plan-relative) -> its block scale
        self._handles: dict = {}
        index = self._index()
        scales = self._split_scales(index)
        self.views: dict[str, tuple[str, int, int, int]] = {}  # per-expert name -> (fused tensor, expert, rows)
        self._split_fused_experts(index, mtp)
        skipped: dict[str, int] = {}
        expected = dict(expected_tensors(cfg))
        self.mtp = mtp
        if mtp:
            has_head = any(name.startswith(MTP_PREFIX) for name in index)
            if not has_head or mtp_layers == 0:
                raise NoDraftHeadError(f"{folder}: --speculative mtp needs the model's multi-token-prediction head "
                                       f"and this checkpoint has none (no mtp.* tensors"
                                       f"{'; mtp_num_hidden_layers is 0' if mtp_layers == 0 else ''}): build "
                                       f"without --speculative")
            if mtp_layers not in (None, 1):
                raise UnsupportedError(f"{folder}: mtp_num_hidden_layers {mtp_layers}: Kestrel drafts with one MTP "
                                       f"layer (every released Qwen3.5 and Qwen3-Next has one)")
            expected.update(mtp_expected_tensors(cfg))
        self.tensors: dict[str, tuple[str, str, str, tuple]] = {}
        for hf_name, (fname, dtype, shape) in index.items():
            rel = hf_name[len(self.prefix):] if hf_name.startswith(self.prefix) else None
            if hf_name == "lm_head.weight":
                rel = "lm_head.weight"
            if mtp and hf_name.startswith(MTP_PREFIX):
                rel = hf_name
            skip = _skipped_part(hf_name, mtp)
            if skip:
                skipped[skip] = skipped.get(skip, 0) + 1
                continue
            if rel == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the embedding table is the output projection
            if rel not in expected and rel != "lm_head.weight":
                raise CheckpointError(f"{folder}: unexpected tensor {hf_name!r}: not part of a {cfg.model_type} "
                                      f"model with this config (is config.json the right one?)")
            self.tensors[rel] = (fname, hf_name, dtype, shape)
            if hf_name in scales:
                self.scales[rel] = scales.pop(hf_name)
        orphan = next((name for name in scales if name not in index), None)  # the rest scale skipped tensors
        if orphan:
            raise CheckpointError(f"{folder}: unexpected tensor {orphan + SCALE_SUFFIX!r}: an FP8 block scale without "
                                  f"its matrix {orphan!r}")
        if not cfg.tie_word_embeddings:
            expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        missing = [rel for rel in expected if rel not in self.tensors]
        for rel, shape in expected.items():
            hf_name = rel if rel == "lm_head.weight" or rel.startswith(MTP_PREFIX) else self.prefix + rel
            if rel not in self.tensors:
                more = f"; {len(missing) - 1} more tensors missing" if len(missing) > 1 else ""
                raise CheckpointError(f"{folder}: missing tensor {hf_name!r} (expected shape {list(shape)}{more})")
            _, _, dtype, got = self.tensors[rel]
            if tuple(got) != tuple(shape):
                raise CheckpointError(f"{folder}: tensor {hf_name!r} has shape {list(got)}, "
                                      f"expected {list(shape)} from config.json")
            if dtype == FP8_DTYPE or rel in self.scales:
                self._check_fp8(rel, hf_name, dtype, got)
            elif dtype not in CHECKPOINT_DTYPES:
                raise CheckpointError(f"{folder}: tensor {hf_name!r} has dtype {dtype}; supported: "
                                      f"{', '.join(CHECKPOINT_DTYPES)} (and {FP8_DTYPE} with block scales in an FP8 "
                                      f"release)")
        for what, n in skipped.items():
            self.notices.append(f"skipping the {what} ({n} tensors): Kestrel compiles the text model")
        if self.scales:
            self.notices.append(f"FP8 checkpoint: {len(self.scales)} matrices in e4m3 with {fp8.rows}x{fp8.cols} "
                                f"block scales, each dequantized to fp32 as it is read (then --quant applies)")

    def _split_fused_experts(self, index: dict, mtp: bool) -> None:
        """Experts stored fused, as transformers' own Qwen3NextExperts holds them (``mlp.experts.gate_up_proj``
        [E, 2I, H]: each expert's gate rows then its up rows; ``mlp.experts.down_proj`` [E, H, I]), become the
        per-expert tensors the rest of the compiler names (``mlp.experts.{e}.gate_proj.weight`` ...), each read
        as its slice of the fused tensor (``read``); a checkpoint may store either layout, not both."""
        cfg = self.cfg
        for name in [n for n in index if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
            if _skipped_part(name, mtp):
                continue  # skipped with the rest of its part (counted as one tensor there)
            m = re.search(r"layers\.(\d+)\.mlp\.", name)
            layer = MTP_MLP_LAYER if name.startswith(MTP_PREFIX) else int(m.group(1)) if m else None
            if layer is None or layer >= cfg.num_hidden_layers or cfg.mlp_type(layer) != "moe":
                raise CheckpointError(f"{self.folder}: unexpected tensor {name!r}: not part of a {cfg.model_type} "
                                      f"model with this config (is config.json the right one?)")
            fname, dtype, shape = index.pop(name)
            base, proj = name.rsplit(".", 1)
            e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            parts = {"gate_up_proj": [("gate_proj", 0, i), ("up_proj", i, 2 * i)], "down_proj": [("down_proj", 0, h)]}
            want = (e, 2 * i, h) if proj == "gate_up_proj" else (e, h, i)
            if dtype == FP8_DTYPE:
                raise CheckpointError(f"{self.folder}: tensor {name!r} holds fused experts in FP8; Kestrel reads FP8 "
                                      f"experts one tensor each (as Qwen's FP8 releases store them)")
            if tuple(shape) != want:
                raise CheckpointError(f"{self.folder}: tensor {name!r} has shape {list(shape)}, expected {list(want)} "
                                      f"(fused experts) from config.json")
            for x in range(e):
                for part, lo, hi in parts[proj]:
                    virtual = f"{base}.{x}.{part}.weight"
                    if virtual in index:
                        raise CheckpointError(f"{self.folder}: experts stored twice: {name!r} and {virtual!r}; keep "
                                              f"one layout")
                    index[virtual] = (fname, dtype, (hi - lo,) + tuple(shape[2:]))
                    self.views[virtual] = (name, x, lo, hi)

    def _split_scales(self, index: dict) -> dict[str, tuple[str, str, str, tuple]]:
        """Take the FP8 block scales out of ``index``: {matrix's hf name: (file, scale's hf name, dtype, shape)}."""
        names = [n for n in index if n.endswith(".weight" + SCALE_SUFFIX)]
        if names and self.fp8 is None:
            raise CheckpointError(f"{self.folder}: tensor {names[0]!r} is an FP8 block scale, but config.json has no "
                                  f"quantization_config with quant_method 'fp8'; restore the release's config.json")
        scales = {}
        for name in names:
            fname, dtype, shape = index.pop(name)
            scales[name[:-len(SCALE_SUFFIX)]] = (fname, name, dtype, shape)
        return scales

    def _check_fp8(self, rel: str, hf_name: str, dtype: str, shape: tuple) -> None:
        if dtype != FP8_DTYPE:
            raise CheckpointError(f"{self.folder}: tensor {hf_name!r} has an FP8 block scale but dtype {dtype}; "
                                  f"only {FP8_DTYPE} matrices are scaled")
        if self.fp8 is None:
            raise CheckpointError(f"{self.folder}: tensor {hf_name!r} has dtype {FP8_DTYPE}, but config.json has no "
                                  f"quantization_config with quant_method 'fp8'; restore the release's config.json")
        if rel not in self.scales:
            raise CheckpointError(f"{self.folder}: FP8 tensor {hf_name!r} has no block scale "
                                  f"{hf_name + SCALE_SUFFIX!r}; the checkpoint is incomplete")
        _, scale_name, scale_dtype, scale_shape = self.scales[rel]
        if len(shape) != 2:
            raise CheckpointError(f"{self.folder}: FP8 tensor {hf_name!r} has shape {list(shape)}; block scales "
                                  f"apply to matrices")
        want = self.fp8.scale_shape(shape)
        if tuple(scale_shape) != want:
            raise CheckpointError(f"{self.folder}: tensor {scale_name!r} has shape {list(scale_shape)}, expected "
                                  f"{list(want)} ({list(shape)} in {self.fp8.rows}x{self.fp8.cols} blocks, "
                                  f"weight_block_size in config.json)")
        if scale_dtype not in SCALE_DTYPES:
            raise CheckpointError(f"{self.folder}: tensor {scale_name!r} has dtype {scale_dtype}; FP8 block scales "
                                  f"are {', '.join(SCALE_DTYPES)}")

    def _index(self) -> dict[str, tuple[str, str, tuple]]:

        idx_path = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        if os.path.exists(idx_path):
            try:
                with open(idx_path, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except OSError as e:
                raise CheckpointError(f"{idx_path}: cannot be read ({e.strerror or e})") from None
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{idx_path}: not a valid safetensors index (needs a 'weight_map')") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{idx_path}: not a valid safetensors index ('weight_map' maps names to files)")
            files = sorted(set(weight_map.values()))
            for fname in files:  # a shard is named inside this folder: no absolute path, no ".." out of it
                # (lexically: a shard may be a symbolic link, as in the Hugging Face cache's snapshots)
                if os.path.isabs(fname) or os.path.normpath(fname).split(os.sep)[0] in ("..", ""):
                    raise CheckpointError(f"{idx_path}: shard {fname!r} is outside the checkpoint folder; refusing "
                                          f"to read it")
        elif os.path.exists(single):
            weight_map, files = None, ["model.safetensors"]
        else:
            raise CheckpointError(f"{self.folder}: no model.safetensors or model.safetensors.index.json")
        index, self.shard_files = {}, files
        for fname in files:
            path = os.path.join(self.folder, fname)
            if not os.path.exists(path):
                raise CheckpointError(f"{self.folder}: shard {fname!r} listed in the index is missing")
            if not os.access(path, os.R_OK):
                raise CheckpointError(f"{path}: permission denied; make it readable (chmod +r)")
            try:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        index[name] = (fname, sl.get_dtype(), tuple(sl.get_shape()))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in index or index[name][0] != fname:
                    raise CheckpointError(f"{self.folder}: index lists {name!r} in {fname!r}, but it is not there")
        return index

    def read(self, rel: str):
        """Load one tensor (as stored; an FP8 matrix dequantized to fp32) from its shard; only that tensor is in
        memory."""

        fname, hf_name, _, _ = self.tensors[rel]
        if hf_name in self.views:
            fused, x, lo, hi = self.views[hf_name]
            t = self._slice(fname, fused)[x:x + 1, lo:hi][0]
        else:
            t = self._get(fname, hf_name)
        if rel in self.scales:
            scale_file, scale_name = self.scales[rel][:2]
            t = dequantize(t, self._get(scale_file, scale_name), self.fp8)
        if not torch.isfinite(t).all():  # scanned as it streams through: a NaN or Inf never reaches a plan
            bad = int((~torch.isfinite(t)).sum())
            what = f"{self.views[hf_name][0]!r} (expert {self.views[hf_name][1]})" if hf_name in self.views else \
                repr(hf_name)
            raise CheckpointError(f"{os.path.join(self.folder, fname)}: tensor {what} holds {bad} non-finite "
                                  f"values (NaN or Inf); fix or re-export the checkpoint")
        return t

    def _handle(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.folder, fname), framework="pt")
        return self._handles[fname]

    def _get(self, fname: str, hf_name: str):
        return self._handle(fname).get_tensor(hf_name)

    def _slice(self, fname: str, hf_name: str):
        return self._handle(fname).get_slice(hf_name)

    def files(self) -> list[str]:
        """Every file of the checkpoint a build reads (an output must never be one of them)."""
        names = {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json"}
        names |= set(self.shard_files)
        return [os.path.join(self.folder, n) for n in sorted(names) if os.path.exists(os.path.join(self.folder, n))]

    def close(self) -> None:
        self._handles.clear()


def open_checkpoint(folder: str, mtp: bool = False) -> Checkpoint:
    raw, cfg = read_config(folder)
    fp8 = parse_quantization(raw, os.path.join(folder, "config.json"))
    return Checkpoint(folder, cfg, mtp, mtp_layers_in(raw), fp8)
