"""Random weights for benchmarking (``kestrelc build ... --weights random``): the plan records a seed,
and the runtime fills the whole weights region on the device with this kernel (the CPU path with
the numpy twin), like vLLM's dummy load format. Never the default.

The region is filled in chunks of CHUNK_WORDS words (kernel arguments are 32-bit); word i of chunk
c is h = fmix32(s * 0x9E3779B1 + i * 0x85EBCA77 + 0x165667B1) with s = seed + c * 0x632BE5AB, then
(h & 0x807F807F) | 0x3C003C00: read as two bf16 (or one f32) that is a random sign and mantissa
with exponent 2^-7, so every weight is finite and about +-0.01 whatever its dtype. The mask keeps
fixed bits in every nibble, so q4 nibbles are not uniform (bits 0x3C003C00 set: nibble 0xC is about
a quarter of them; the mean square of q - 8 is 20).

Read as f16, those words are about +-1: as q4 scales they would make every product about 4.5
sqrt(K) times larger than its input, and the 27B shape's activations overflow the q4 product's fp16
lanes within a layer (NaN logits on the GPU and the CPU reference alike; bench/results/stop33). So a
plan made with ``q4_scales`` (the manifest's weights entry) refills each q4 weight's scales (one
contiguous run after its nibbles, kernels/matvec.py) with its own launch: sign and 8 mantissa bits
random, the f16 exponent 2^e with e = round(-log2(5 sqrt(K))), so a product's output is about as
large as its input (gain 0.77-1.41 at the Qwen3.5 shapes) and every model stays finite at any depth.
"""
from __future__ import annotations

import math

import numpy as np
import triton
import triton.language as tl

from kestrel.kernels.sample import counter_hash

MASK, BITS = 0x807F807F, 0x3C003C00
Q4_SCALE_MASK = 0x80FF80FF  # two f16: a random sign and the 8 high mantissa bits; the exponent per weight
Q4_SCALE_GAIN = 5.0  # |scale| ~ 1 / (Q4_SCALE_GAIN sqrt(K)): the rms of q - 8 (4.47) times the mean mantissa (1.12)


CHUNK_WORDS = 1 << 28


def chunk_seed(seed: int, chunk: int) -> int:
    return (seed + chunk * 0x632BE5AB) & 0x7FFFFFFF


def chunks(n_words: int) -> list[tuple[int, int, int]]:
    """(chunk index, first word, words) of each chunk of an ``n_words`` region."""
    return [(c, lo, min(CHUNK_WORDS, n_words - lo)) for c, lo in enumerate(range(0, n_words, CHUNK_WORDS))]


def q4_scale_bits(k: int) -> int:
    """The fixed bits of a q4 weight's scale words (two f16 halves): the exponent for inputs of width k."""
    e = 15 + round(-math.log2(Q4_SCALE_GAIN * math.sqrt(k)))
    return (min(max(e, 1), 30) << 10) * 0x10001


def fill_runs(n_words: int, seed: int, q4_weights=()) -> list[tuple[int, int, int, int, int]]:
    """(first word, words, seed, mask, bits) of each fill launch, in launch order: the whole region chunk
    by chunk, then (``q4_weights``: (byte offset, N, K, group) of each q4 weight in the region) the
    scales of each, a run of N K / group f16 (its last odd half, if any, left as the chunk wrote it)."""
    runs = [(lo, n, chunk_seed(seed, c), MASK, BITS) for c, lo, n in chunks(n_words)]
    for off, n, k, group in sorted(set(q4_weights)):
        first, words = (off + n * k // 2) // 4, n * (k // group) // 2
        for c, lo, m in chunks(words):
            runs.append((first + lo, m, chunk_seed(seed ^ (first * 0x2545F491 & 0x7FFFFFFF), c + 1), Q4_SCALE_MASK,
                         q4_scale_bits(k)))
    return runs


REF_PIECE_WORDS = 1 << 16  # fill_random_ref hashes a run this many words at a time (256 KB arrays: in cache)


def fill_random_ref(n_words: int, seed: int, q4_weights=()) -> np.ndarray:
    """The whole region as the runtime's fill launches leave it (fill_runs)."""
    return fill_random_words(0, n_words, fill_runs(n_words, seed, q4_weights))


def fill_random_words(lo: int, hi: int, runs) -> np.ndarray:
    """Words lo .. hi - 1 of the region the fill ``runs`` (fill_runs, in launch order: a later run overwrites)
    leave, made without the rest of it (the CPU path builds a random plan weight by weight), hashed in pieces of
    REF_PIECE_WORDS words: the temporaries stay in cache where a whole run's took ~8 bytes a word."""
    out = np.zeros(hi - lo, dtype=np.uint32)
    for first, n, s, mask, bits in runs:
        a, b = max(first, lo), min(first + n, hi)
        for p in range(a, b, REF_PIECE_WORDS):
            m = min(REF_PIECE_WORDS, b - p)
            out[p - lo:p - lo + m] = _fill_chunk(m, s, mask, bits, first=p - first)
    return out


def _fill_chunk(n_words: int, seed: int, mask: int = MASK, bits: int = BITS, first: int = 0) -> np.ndarray:
    """Words first .. first + n_words - 1 of a run of seed ``seed``: counter_hash in uint32 arithmetic (numpy's
    uint32 products wrap as the device's do), in place on one array."""
    x = np.arange(first, first + n_words, dtype=np.uint32)  # a run is under 2^32 words (CHUNK_WORDS)
    x *= np.uint32(0x85EBCA77)
    x += np.uint32((seed * 0x9E3779B1 + 0x165667B1) & 0xFFFFFFFF)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x ^= x >> np.uint32(shift)
        x *= np.uint32(mul)
    x ^= x >> np.uint32(16)
    x &= np.uint32(mask)
    x |= np.uint32(bits)
    return x


@triton.jit
def fill_random_kernel(out_ptr, seed, n_words, mask, bits, BLOCK: tl.constexpr):
    """out[i] = (hash & mask) | bits as above, for i < n_words (grid: n_words / BLOCK; mask and bits
    are the uint32 words' int32 bit patterns)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = (counter_hash(seed, i) & mask.to(tl.uint32, bitcast=True)) | bits.to(tl.uint32, bitcast=True)
    tl.store(out_ptr + i, x.to(tl.int32, bitcast=True), mask=i < n_words)


FILL_BLOCK = 1024
FILL_TYPES = ["*i32", "i32", "i32", "i32", "i32"]


def as_i32(word: int) -> int:
    """A uint32 word as the int32 kernel argument with its bits."""
    return word - (1 << 32) if word >= 1 << 31 else word
