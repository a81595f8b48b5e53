"""A random-weight Q4_0 GGUF at a Qwen3-Next or Qwen3.5 MoE model's real shape, written by llama.cpp's own converter.

usage: python3 bench/mkgguf_next.py LLAMA_DIR MODEL OUT.gguf [--layers N] [--seed 0] [--check]
       python3 bench/mkgguf_next.py LLAMA_DIR --self-check
  LLAMA_DIR: llama.cpp's source tree (its gguf-py and conversion package are imported from there).
  MODEL: a preset of kestrel.compiler.presets with model_type qwen3_next (qwen3-next-80b-a3b, tiny-next) or
  qwen3_5_moe_text (qwen3.5-35b-a3b, tiny-moe), or a config.json path (either model_type, top level or
  text_config); --layers N keeps the first N layers (the same shape, less depth: 12 of the 80B's 48 is
  9 Gated DeltaNet + 3 attention layers; at least one attention layer, so N >= 4: llama.cpp aborts on a
  qwen3next / qwen35moe model without one).

Tensor names and shapes come from transformers' Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM built on the
meta device, and go through llama.cpp's Qwen3NextModel / Qwen3_5MoeTextModel converter class unchanged
(arch qwen3next / qwen35moe; its renames, qwen3next's in_proj_qkvz split into attn_qkv + attn_gate and
in_proj_ba into ssm_ba, qwen35moe's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a into attn_qkv /
attn_gate / ssm_beta / ssm_alpha with the V heads reordered to tiled order, the fused experts split into
ffn_gate_exps / ffn_up_exps / ffn_down_exps, A_log -> ssm_a, dt_bias -> ssm_dt.bias, conv1d squeezed,
norms + 1, its hparams; qwen35moe's rope.dimension_sections [11, 11, 10, 0] when the config has no
mrope_section; no MTP layer). Only the values are ours, and the converter runs lazily, so nothing is held
in memory: each tensor is made when it is written (the 80B's 45 GB streams through about 0.55 GB resident,
the same at any depth; the 35B-A3B's likewise).

Types are what `llama-quantize ... Q4_0` gives (llama-quant.cpp, no imatrix): every 2-D and 3-D weight
Q4_0, output.weight Q6_K (Q8_0 when its rows are not a multiple of 256; token_embd.weight too when the
embeddings are tied), attn_k / attn_v / attn_qkv Q8_0 in a model of exactly 8 experts (tiny-next, tiny-moe;
llama-quant.cpp's n_expert == 8 rule), and what llama-quantize does not
quantize left as the converter writes it: ffn_gate_inp (router), ffn_gate_inp_shexp, ssm_conv1d, norms
and 1-D tensors F32. A row not a multiple of 32 would be F16 (llama-quantize's fallback). Quantized
tensors are written directly as random blocks (Q4_0: f16 scale 0.01, random nibbles: weights in
[-0.08, 0.07]; Q6_K / Q8_0 alike, small), repeating a 32 MB pool of blocks, so the writer runs at disk
speed; the router is random normal (std 0.02, so tokens spread over the experts as real ones do: zeros
would send every token to the same experts and flatter batched prompt processing); the GDN conv is
random (std 0.5) and its output norm ones, so the Gated DeltaNet carries nonzero values; other F32
tensors are zeros (the converter adds 1 to the RMSNorm weights; A_log 0 gives ssm_a = -1). Logits came
out finite at 48 layers on llama.cpp's CPU backend (the 80B). The vocabulary is synthetic (one token per
id). Timing only: the values are meaningless. Sizes (Q4_0, output Q6_K): the 80B 45.2 GB; the 35B-A3B
0.475 GB a layer + 0.70 GB (embedding, output): 4 layers 2.61 GB (76 tensors), 40 19.7 GB.

--self-check: the block makers' layouts round-trip through gguf-py's dequantize, then tiny-next and
tiny-moe are written and read back with gguf-py's reader against the tensors and keys llama.cpp's
qwen3next and qwen35moe loaders ask for (src/models/qwen3next.cpp, src/models/qwen35moe.cpp). Needs
LLAMA_DIR only, no build.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

POOL_BYTES = 32 << 20  # the repeated pool of blocks, per type


# model_type -> (the transformers class the converter is registered for, llama.cpp's arch: the loader to check against)
ARCHS = {"qwen3_next": ("Qwen3NextForCausalLM", "qwen3next"),
         "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "qwen35moe")}


def load_config(model: str, layers: int | None) -> dict:
    if model.endswith(".json"):
        cfg = json.load(open(model))
        cfg = dict(cfg.get("text_config", cfg))
    else:
        from kestrel.compiler.presets import PRESETS, SHAPES
        if model not in PRESETS and model not in SHAPES:
            raise SystemExit(f"unknown preset {model!r}")
        cfg = dict(PRESETS.get(model) or SHAPES[model])
    if cfg.get("model_type") not in ARCHS:
        raise SystemExit(f"{model}: model_type {cfg.get('model_type')!r}, this writer is for qwen3_next and "
                         "qwen3_5_moe_text (dense qwen3_5: ../shared/peers/llamacpp/mkgguf.py)")
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise SystemExit(f"--layers {layers}: the model has {cfg['num_hidden_layers']}")
        cfg["num_hidden_layers"] = layers
        if cfg.get("layer_types"):
            cfg["layer_types"] = cfg["layer_types"][:layers]
    n_attn = sum(t == "full_attention" for t in cfg["layer_types"]) if cfg.get("layer_types") else \
        cfg["num_hidden_layers"] // cfg.get("full_attention_interval", 4)
    if n_attn == 0:  # seen: llama-bench aborts, GGML_ASSERT(buffer) in llama_kv_cache::set_input_k_idxs
        raise SystemExit(f"{model}: {cfg['num_hidden_layers']} layers hold no full-attention layer, and llama.cpp "
                         f"cannot run a {ARCHS[cfg['model_type']][1]} model without one: keep at least "
                         "full_attention_interval (4)")
    cfg["architectures"] = [ARCHS[cfg["model_type"]][0]]
    cfg.setdefault("bos_token_id", None)
    return cfg


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    import transformers
    model_cls = getattr(transformers, cfg["architectures"][0])  # config_class: Qwen3NextConfig, Qwen3_5MoeTextConfig
    with torch.device("meta"):
        m = model_cls(model_cls.config_class(**{k: v for k, v in cfg.items() if k != "architectures"}))
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)  # a tied checkpoint has none; llama.cpp then reads token_embd
    return shapes


class BlockPools:
    """Valid random blocks of Q4_0 / Q8_0 / Q6_K, POOL_BLOCKS of each, made once and written repeatedly."""

    def __init__(self, gguf, seed: int, pool_bytes: int = POOL_BYTES):
        Q = gguf.GGMLQuantizationType
        self.gguf, self.pool_bytes, self.rng, self.pools = gguf, pool_bytes, np.random.default_rng(seed), {}
        self.makers = {Q.Q4_0: self.q4_0, Q.Q8_0: self.q8_0, Q.Q6_K: self.q6_k}

    @staticmethod
    def f16_bytes(x: float, n: int) -> np.ndarray:
        return np.broadcast_to(np.frombuffer(np.float16(x).tobytes(), np.uint8), (n, 2))

    def q4_0(self, n: int) -> np.ndarray:  # d: f16, qs: 16 bytes, element j low nibble, j+16 high; w = (q-8)*d
        b = np.empty((n, 18), np.uint8)
        b[:, 0:2] = self.f16_bytes(0.01, n)
        b[:, 2:] = self.rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
        return b

    def q8_0(self, n: int) -> np.ndarray:  # d: f16, qs: 32 int8; w = q*d
        b = np.empty((n, 34), np.uint8)
        b[:, 0:2] = self.f16_bytes(0.002, n)
        b[:, 2:] = self.rng.integers(-40, 40, size=(n, 32), dtype=np.int8).view(np.uint8)
        return b

    def q6_k(self, n: int) -> np.ndarray:  # ql 128, qh 64, scales 16 int8, d f16; w = d*scale*(q-32)
        b = np.empty((n, 210), np.uint8)
        b[:, :192] = self.rng.integers(0, 256, size=(n, 192), dtype=np.uint8)
        b[:, 192:208] = self.rng.integers(1, 16, size=(n, 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = self.f16_bytes(0.0002, n)
        return b

    def pool(self, qtype, want_blocks: int | None = None) -> np.ndarray:
        """The pool of qtype: pool_bytes of blocks, or want_blocks if fewer (as small as a small model needs)."""
        n = self.pool_bytes // self.gguf.GGML_QUANT_SIZES[qtype][1]
        n = min(n, want_blocks or n)
        if qtype not in self.pools or len(self.pools[qtype]) < n * self.gguf.GGML_QUANT_SIZES[qtype][1]:
            self.pools[qtype] = self.makers[qtype](n).reshape(-1)
        return self.pools[qtype]

    def tensor(self, byte_shape: tuple[int, ...], qtype):
        """A tensor of byte_shape made of pool blocks, written chunk by chunk (nothing held)."""
        nbytes = int(np.prod(byte_shape))
        pool = self.pool(qtype, nbytes // self.gguf.GGML_QUANT_SIZES[qtype][1])
        chunks = [(lambda k=k: pool[:k]) for k in [len(pool)] * (nbytes // len(pool)) + [nbytes % len(pool)] if k]
        return self.gguf.LazyChunkedTensor(chunks, byte_shape, np.uint8)


def build_converter(llama: str, cfg: dict, out: pathlib.Path, seed: int, name: str):
    sys.path[:0] = [llama + "/gguf-py", llama]
    import gguf
    from conversion import get_model_class
    Q = gguf.GGMLQuantizationType
    shapes = hf_shapes(cfg)
    pools = BlockPools(gguf, seed)

    _orig_quantize = gguf.quants.quantize

    def quantize(data, qtype):  # the converter asks this for every tensor (lazily); ours: the block types
        if qtype in pools.makers:
            return pools.tensor(gguf.quant_shape_to_byte_shape(data.shape, qtype), qtype)
        return _orig_quantize(data, qtype)
    gguf.quants.quantize = quantize

    # Qwen3NextModel, or Qwen3_5MoeTextModel (QWEN35MOE: the same conversion on Qwen3NextModel, plus the V heads
    # reordered to tiled order and rope.dimension_sections written, [11, 11, 10, 0] when the config has no
    # mrope_section). Ours is a subclass, so a second model in one process starts from the class as registered.
    base = get_model_class(cfg["architectures"][0])
    from conversion.base import LazyTorchTensor
    gen = torch.Generator().manual_seed(seed)

    def values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("mlp.gate.weight"):  # the router: random, so tokens spread over the experts
            return torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
        if name.endswith("linear_attn.conv1d.weight"):  # nonzero q / k / v into the Gated DeltaNet
            return torch.randn(shape, generator=gen, dtype=torch.float32) * 0.5
        if name.endswith("linear_attn.norm.weight"):  # its output norm is plain w (no + 1): ones
            return torch.ones(shape, dtype=torch.float32)
        return torch.zeros(shape, dtype=torch.float32)

    # The type of each tensor, as llama-quantize Q4_0 leaves it. The converter asks tensor_force_quant
    # right after modify_tensors yields the tensor, so modify_tensors below records the shape it needs.
    last_shape: dict[str, tuple[int, ...]] = {}
    tied = bool(cfg.get("tie_word_embeddings"))
    keep_f32 = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.SSM_CONV1D)
    bump_q8 = cfg["num_experts"] == 8  # llama-quant.cpp: n_expert == 8 -> attn_v (+ attn_qkv) and attn_k Q8_0

    class Random(base):
        model_arch = base.model_arch
        no_mtp = True  # the MTP layer is not in transformers' model (nor in ours); llama-bench does not use it

        def index_tensors(self, remote_hf_model_id=None):
            return {k: (lambda k=k, s=s: LazyTorchTensor(
                meta=LazyTorchTensor.meta_with_dtype_and_shape(torch.float32, s), func=lambda: values(k, s)))
                for k, s in shapes.items()}

        def modify_tensors(self, data_torch, name, bid):
            for new_name, t in super().modify_tensors(data_torch, name, bid):
                last_shape[new_name] = tuple(t.shape)
                yield new_name, t

        def tensor_force_quant(self, name, new_name, bid, n_dims):
            if n_dims < 2 or new_name.endswith("_norm.weight") or not new_name.endswith(".weight") or \
                    any(self.match_model_tensor_name(new_name, key, bid) for key in keep_f32):
                return False  # the converter makes these F32, and llama-quantize leaves them so
            ne0 = last_shape[new_name][-1]
            if new_name == "output.weight" or (tied and new_name == "token_embd.weight"):  # llama-quantize's rule
                return Q.Q6_K if ne0 % 256 == 0 else Q.Q8_0
            if bump_q8 and new_name.endswith(("attn_k.weight", "attn_v.weight", "attn_qkv.weight")):
                return Q.Q8_0 if ne0 % 32 == 0 else Q.F16
            return Q.Q4_0 if ne0 % 32 == 0 else Q.F16

        def set_vocab(self):
            n = cfg["vocab_size"]
            self.gguf_writer.add_tokenizer_model("gpt2")
            self.gguf_writer.add_tokenizer_pre("qwen2")
            self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
            self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
            self.gguf_writer.add_token_merges(["<t1> <t2>"])
            self.gguf_writer.add_eos_token_id(cfg["eos_token_id"])
            self.gguf_writer.add_bos_token_id(cfg["eos_token_id"])

    d = pathlib.Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    conv = Random(d, gguf.LlamaFileType.MOSTLY_Q4_0, out, eager=False)  # lazy: tensors made as written
    conv.model_name = "kestrel-random-" + name
    return gguf, conv, shapes


def write(llama: str, model: str, out: str, layers: int | None, seed: int) -> None:
    cfg = load_config(model, layers)
    t0 = time.time()
    name = pathlib.Path(model).stem + (f"-{layers}l" if layers else "")
    part = pathlib.Path(out + ".part")  # renamed when complete: a killed run leaves no GGUF that looks whole
    part.unlink(missing_ok=True)
    gguf, conv, shapes = build_converter(llama, cfg, part, seed, name)
    print(f"{model}: {cfg['num_hidden_layers']} layers, {len(shapes)} HF tensors, "
          f"{sum(int(np.prod(s)) for s in shapes.values()) / 1e9:.2f} B params", flush=True)
    conv.prepare_tensors()
    conv.prepare_metadata(vocab_only=False)
    w = conv.gguf_writer
    need = sum(ti.nbytes for t in w.tensors for ti in t.values())
    free = shutil.disk_usage(pathlib.Path(out).resolve().parent).free
    if need > free - (1 << 30):
        raise SystemExit(f"{out}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free there")
    t1 = time.time()
    w.write_header_to_file(path=conv.fname_out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    part.replace(out)
    size = pathlib.Path(out).stat().st_size
    t2 = time.time()
    print(f"wrote {out} {size / 1e9:.2f} GB in {t2 - t0:.1f} s (setup {t1 - t0:.1f} s, writing "
          f"{size / 1e9 / (t2 - t1):.2f} GB/s)", flush=True)


# ---------------------------------------------------------------------------------------------------
def self_check(llama: str) -> None:
    sys.path[:0] = [llama + "/gguf-py", llama]
    import gguf
    Q = gguf.GGMLQuantizationType
    pools = BlockPools(gguf, 0, pool_bytes=64 * 210)
    # 1. the block makers: gguf-py's dequantize reads them as the values meant
    w = gguf.quants.dequantize(pools.pool(Q.Q4_0, 64).reshape(4, -1), Q.Q4_0)
    assert w.shape == (4, 64 * 32 // 4), w.shape
    q = np.round(w / np.float32(np.float16(0.01))).astype(int) + 8
    assert np.allclose((q - 8) * np.float32(np.float16(0.01)), w) and q.min() >= 0 and q.max() <= 15
    nib = pools.pool(Q.Q4_0, 64).reshape(-1, 18)[:, 2:]
    assert (q.reshape(-1, 32)[:, :16] == (nib & 15)).all() and (q.reshape(-1, 32)[:, 16:] == (nib >> 4)).all()
    w8 = gguf.quants.dequantize(pools.pool(Q.Q8_0, 64).reshape(2, -1), Q.Q8_0)
    assert w8.shape == (2, 32 * 32) and np.abs(w8).max() <= 40 * 0.0021
    w6 = gguf.quants.dequantize(pools.pool(Q.Q6_K, 64).reshape(1, -1), Q.Q6_K)
    assert w6.shape == (1, 64 * 256) and np.isfinite(w6).all() and 0 < np.abs(w6).max() <= 0.0002 * 15 * 32 * 1.01
    print("blocks: Q4_0 / Q8_0 / Q6_K round-trip through gguf-py's dequantize")
    # 2. tiny-next and tiny-moe written and read back against what src/models/qwen3next.cpp and
    # src/models/qwen35moe.cpp load
    for model in ("tiny-next", "tiny-moe"):
        with tempfile.TemporaryDirectory() as t:
            out = pathlib.Path(t) / f"{model}.gguf"
            write(llama, model, str(out), None, 0)
            check_file(gguf, str(out), load_config(model, None))
    print("self-check passed")


def check_file(gguf, path: str, cfg: dict) -> None:
    """Keys and tensors (name, ggml shape, type) against llama.cpp's loader of the arch: qwen3next
    (src/models/qwen3next.cpp) or qwen35moe (src/models/qwen35moe.cpp)."""
    Q = gguf.GGMLQuantizationType
    r = gguf.GGUFReader(path)
    kv = {f.name: f.contents() for f in r.fields.values()}
    a = ARCHS[cfg["model_type"]][1]
    assert kv["general.architecture"] == a, (kv["general.architecture"], a)
    L, E = cfg["num_hidden_layers"], cfg["hidden_size"]
    nk, nv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim"))
    hd = cfg.get("head_dim") or E // cfg["num_attention_heads"]
    want_kv = {"block_count": L, "embedding_length": E, "expert_count": cfg["num_experts"],
               "expert_used_count": cfg["num_experts_per_tok"],
               "expert_feed_forward_length": cfg["moe_intermediate_size"],
               "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"],
               "ssm.conv_kernel": cfg["linear_conv_kernel_dim"], "ssm.state_size": dk, "ssm.group_count": nk,
               "ssm.time_step_rank": nv, "ssm.inner_size": dv * nv, "attention.head_count": cfg["num_attention_heads"],
               "attention.head_count_kv": cfg["num_key_value_heads"], "attention.key_length": hd,
               "rope.dimension_count": int(hd * cfg["rope_parameters"].get("partial_rotary_factor", 0.25)),
               "full_attention_interval": cfg.get("full_attention_interval", 4),
               "context_length": cfg["max_position_embeddings"]}
    for k, v in want_kv.items():
        assert kv.get(f"{a}.{k}") == v, (k, kv.get(f"{a}.{k}"), v)
    assert abs(kv[f"{a}.attention.layer_norm_rms_epsilon"] - cfg["rms_norm_eps"]) < 1e-9  # required by both
    assert f"{a}.nextn_predict_layers" not in kv  # no MTP layer: block_count is the trunk's
    if a == "qwen35moe":  # required there (get_key_or_arr(..., 4, true)): 4 entries; the converter's default
        mrope = list(cfg["rope_parameters"].get("mrope_section", [11, 11, 10]))
        assert kv[f"{a}.rope.dimension_sections"] == (mrope + [0] * 4)[:4], kv[f"{a}.rope.dimension_sections"]
    assert dk == dv, f"llama.cpp's {a} loader takes the GDN value head dim to equal the key head dim"
    recurrent = cfg.get("layer_types") or ["linear_attention" if (i + 1) % cfg.get("full_attention_interval", 4)
                                           else "full_attention" for i in range(L)]
    if f"{a}.attention.recurrent_layers" in kv:  # the loader takes it over full_attention_interval: L entries
        assert kv[f"{a}.attention.recurrent_layers"] == [t == "linear_attention" for t in recurrent]
    types = {t.name: (tuple(int(x) for x in t.shape), Q(t.tensor_type)) for t in r.tensors}
    Kd, Vd = dk * nk, dv * nv
    F32, Q4 = Q.F32, Q.Q4_0
    # llama-quant.cpp: a model of exactly 8 experts gets attn_k, attn_v and attn_qkv Q8_0 (tiny-next, tiny-moe)
    Qkv = Q.Q8_0 if cfg["num_experts"] == 8 else Q4
    head = ((E, cfg["vocab_size"]), Q.Q6_K if E % 256 == 0 else Q.Q8_0)
    want = {"output_norm.weight": ((E,), F32)}
    if cfg.get("tie_word_embeddings"):
        want["token_embd.weight"] = head
    else:
        want |= {"token_embd.weight": ((E, cfg["vocab_size"]), Q4), "output.weight": head}
    X, F, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    for i in range(L):
        b = f"blk.{i}."
        # Both loaders: create_tensor_gate_up_exps takes a fused ffn_gate_up_exps {E, 2F, X} if present, else
        # ffn_gate_exps + ffn_up_exps; the converter writes the separate pair (fuse_gate_up_exps is off).
        # ffn_gate_inp_shexp: the loader asks {E}; the converter writes HF's (1, E) as ggml {E, 1}, which the
        # loader's check_tensor_dims accepts (trailing ne of 1), and llama-quantize sees 1-D (ggml_n_dims).
        want |= {b + "attn_norm.weight": ((E,), F32), b + "post_attention_norm.weight": ((E,), F32),
                 b + "ffn_gate_inp.weight": ((E, X), F32), b + "ffn_gate_exps.weight": ((E, F, X), Q4),
                 b + "ffn_up_exps.weight": ((E, F, X), Q4), b + "ffn_down_exps.weight": ((F, E, X), Q4),
                 b + "ffn_gate_inp_shexp.weight": ((E, 1), F32), b + "ffn_gate_shexp.weight": ((E, S), Q4),
                 b + "ffn_up_shexp.weight": ((E, S), Q4), b + "ffn_down_shexp.weight": ((S, E), Q4)}
        if recurrent[i] == "full_attention":
            # create_tensor_qkv: a fused attn_qkv if present, else attn_q / attn_k / attn_v; the converter
            # writes the separate ones (fuse_qkv is off). attn_q carries the output gate: 2 * H * hd rows.
            H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
            want |= {b + "attn_q.weight": ((E, hd * H * 2), Q4), b + "attn_k.weight": ((E, hd * KV), Qkv),
                     b + "attn_v.weight": ((E, hd * KV), Qkv), b + "attn_output.weight": ((hd * H, E), Q4),
                     b + "attn_q_norm.weight": ((hd,), F32), b + "attn_k_norm.weight": ((hd,), F32)}
        else:
            # attn_qkv / attn_gate are TENSOR_NOT_REQUIRED in both loaders (qwen3next: the legacy ssm_in instead),
            # but both graphs multiply by them, so they must be there. qwen3next: ssm_ba {E, 2 nv} (in_proj_ba);
            # qwen35moe: ssm_beta and ssm_alpha {E, nv} each (in_proj_b, in_proj_a).
            want |= {b + "attn_qkv.weight": ((E, 2 * Kd + Vd), Qkv), b + "attn_gate.weight": ((E, Vd), Q4),
                     b + "ssm_conv1d.weight": ((cfg["linear_conv_kernel_dim"], 2 * Kd + Vd), F32),
                     b + "ssm_dt.bias": ((nv,), F32), b + "ssm_a": ((nv,), F32),
                     b + "ssm_norm.weight": ((dv,), F32), b + "ssm_out.weight": ((Vd, E), Q4)}
            if a == "qwen3next":
                want[b + "ssm_ba.weight"] = ((E, 2 * nv), Q4)
            else:
                want |= {b + "ssm_beta.weight": ((E, nv), Q4), b + "ssm_alpha.weight": ((E, nv), Q4)}
    missing, extra = sorted(set(want) - set(types)), sorted(set(types) - set(want))
    assert not missing and not extra, f"missing {missing[:8]}, extra {extra[:8]}"
    bad = {n: (types[n], want[n]) for n in want if types[n] != want[n]}
    assert not bad, f"(shape, type) differ (got, wanted): {dict(list(bad.items())[:8])}"
    print(f"{path}: {len(types)} tensors and the loader's keys as llama.cpp's {a} loader wants them")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("llama_dir")
    p.add_argument("model", nargs="?")
    p.add_argument("out", nargs="?")
    p.add_argument("--layers", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--self-check", action="store_true")
    p.add_argument("--check", action="store_true", help="read the written file back against the loader's wants")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.self_check:
        return self_check(a.llama_dir)
    if not (a.model and a.out):
        p.error("MODEL and OUT.gguf are needed (or --self-check)")
    write(a.llama_dir, a.model, a.out, a.layers, a.seed)
    if a.check:
        import gguf
        check_file(gguf, a.out, load_config(a.model, a.layers))


if __name__ == "__main__":
    main()
