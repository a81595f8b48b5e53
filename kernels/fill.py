"""Random weights for benchmarking (``kestrelc build ... --weights random``): the plan records a seed,
and the runtime fills the whole weights region on the device with this kernel (the CPU path with
the numpy twin), like vLLM's dummy load format. Never the default.

The region is filled in chunks of CHUNK_WORDS words (kernel arguments are 32-bit); word i of chunk
c is h = fmix32(s * 0x9E3779B1 + i * 0x85EBCA77 + 0x165667B1) with s = seed + c * 0x632BE5AB, then
(h & 0x807F807F) | 0x3C003C00: read as two bf16 (or one f32) that is a random sign and mantissa
with exponent 2^-7, so every weight is finite and about +-0.01 whatever its dtype. The mask keeps
fixed bits in every nibble, so q4 nibbles are not uniform (bits 0x3C003C00 set: nibble 0xC is about
a quarter of them); q4 scales (as f16) are about +-1. Benchmarks only need finite, fixed weights.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kestrel.kernels.sample import counter_hash

MASK, BITS = 0x807F807F, 0x3C003C00


CHUNK_WORDS = 1 << 28


def chunk_seed(seed: int, chunk: int) -> int:
    return (seed + chunk * 0x632BE5AB) & 0x7FFFFFFF


def chunks(n_words: int) -> list[tuple[int, int, int]]:
    """(chunk index, first word, words) of each chunk of an ``n_words`` region."""
    return [(c, lo, min(CHUNK_WORDS, n_words - lo)) for c, lo in enumerate(range(0, n_words, CHUNK_WORDS))]


def fill_random_ref(n_words: int, seed: int) -> np.ndarray:
    """The whole region, chunk by chunk, as the runtime fills it (one fill launch per chunk)."""
    if n_words == 0:
        return np.zeros(0, dtype=np.uint32)
    return np.concatenate([_fill_chunk(n, chunk_seed(seed, c)) for c, _, n in chunks(n_words)])


def _fill_chunk(n_words: int, seed: int) -> np.ndarray:
    i = np.arange(n_words, dtype=np.uint64)
    x = ((np.uint64(seed) * np.uint64(0x9E3779B1) + i * np.uint64(0x85EBCA77) + np.uint64(0x165667B1))
         & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return (x & np.uint32(MASK)) | np.uint32(BITS)


@triton.jit
def fill_random_kernel(out_ptr, seed, n_words, BLOCK: tl.constexpr):
    """out[i] = the word above, for i < n_words (grid: n_words / BLOCK)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = (counter_hash(seed, i) & 0x807F807F) | 0x3C003C00
    tl.store(out_ptr + i, x.to(tl.int32, bitcast=True), mask=i < n_words)


FILL_BLOCK = 1024
FILL_TYPES = ["*i32", "i32", "i32"]
