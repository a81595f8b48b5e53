"""Fine-grained FP8 checkpoints (the "-FP8" releases of Qwen3-Next and Qwen3.5) as a build's input.

The format, as transformers (``integrations/finegrained_fp8.py`` ``Fp8Dequantize``) and vLLM read it: config.json
carries ``quantization_config`` = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bm, bn],
"activation_scheme": "dynamic", ...}; a quantized matrix W [N, K] is stored as ``NAME.weight`` in float8 e4m3
(safetensors dtype F8_E4M3) beside ``NAME.weight_scale_inv`` [ceil(N / bm), ceil(K / bn)] (F32, BF16 or F16), and
W[i, j] = q[i, j] * s[i // bm, j // bn] ("scale_inv" is the factor that takes the codes back to the weight's scale).
A width that is not a multiple of the block ends in a partial block (the ceil above), as vLLM reads it;
transformers' reader refuses such a matrix (its blocks must divide the shape). The tensors the release keeps
unquantized (embeddings, norms, the router, the shared expert's gate, the conv taps) are stored as in the bf16
release.

Kestrel dequantizes each FP8 matrix to fp32 as it is read, one tensor at a time (``dequantize``), so the plan's
precision is --quant's exactly as from a bf16 checkpoint: an FP8 release builds the plan that a checkpoint holding
the dequantized values would. The "dynamic" activation scheme (per-token FP8 activations at run time) is not
reproduced: the step computes activations in its own precision, as transformers does when it dequantizes. Any other
quantization method (GPTQ, AWQ, compressed-tensors, bitsandbytes, MXFP4, ...) is refused before any tensor is read
(``parse_quantization``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kestrel.artifacts.errors import ConfigError, UnsupportedError

FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # NAME.weight's scale is NAME.weight_scale_inv
SCALE_DTYPES = ("F32", "BF16", "F16")
QUANT_KEYS = ("quantization_config", "compression_config")


@dataclass(frozen=True)
class Fp8Blocks:
    """An FP8 checkpoint's block shape: one scale per ``rows`` x ``cols`` block of a matrix."""

    rows: int
    cols: int

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return math.ceil(shape[0] / self.rows), math.ceil(shape[1] / self.cols)


def parse_quantization(raw: dict, where: str) -> Fp8Blocks | None:
    """The checkpoint's quantization (None: unquantized) from config.json (top level or, in the multimodal
    wrapper, its text_config); anything but fine-grained e4m3 FP8 with dynamic activations is refused."""
    found = [(k, t[k]) for t in (raw, raw.get("text_config") or {}) if isinstance(t, dict)
             for k in QUANT_KEYS if t.get(k) is not None]
    if not found:
        return None
    key, q = found[0]
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: {key!r} must be a table")
    method = q.get("quant_method", "?")
    if method != "fp8":
        raise UnsupportedError(f"{where}: the checkpoint is quantized ({key} quant_method {method!r}); Kestrel reads "
                               f"unquantized (bf16 / f16 / f32) or fine-grained FP8 checkpoints: build from the "
                               f"model's bf16 or FP8 release (--quant q4 quantizes it)")
    fmt, act = q.get("fmt", "e4m3"), q.get("activation_scheme", "dynamic")
    block = q.get("weight_block_size")
    if fmt != "e4m3":
        raise UnsupportedError(f"{where}: FP8 format {fmt!r}; Kestrel reads e4m3 FP8 checkpoints")
    if act != "dynamic":
        raise UnsupportedError(f"{where}: FP8 activation_scheme {act!r}; Kestrel reads FP8 checkpoints with dynamic "
                               f"activation scales (as Qwen's FP8 releases are)")
    if block is None:
        raise UnsupportedError(f"{where}: per-tensor FP8 (no weight_block_size); Kestrel reads fine-grained "
                               f"(block-scaled) FP8 checkpoints such as Qwen's FP8 releases")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{where}: {key} weight_block_size must be two positive integers, got {block!r}")
    return Fp8Blocks(*block)


def dequantize(q: torch.Tensor, scale: torch.Tensor, blocks: Fp8Blocks) -> torch.Tensor:
    """W = q * s blockwise, in fp32 (q [N, K] float8_e4m3fn, s [ceil(N / rows), ceil(K / cols)]); one fp32
    copy of W and one K-wide row of scales are all the memory it takes."""
    w = q.to(torch.float32)
    s = scale.to(torch.float32)
    k = w.shape[1]
    for i in range(s.shape[0]):
        w[i * blocks.rows:(i + 1) * blocks.rows] *= s[i].repeat_interleave(blocks.cols)[:k]
    return w
