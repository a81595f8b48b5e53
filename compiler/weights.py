"""Making a plan weight's bytes from the checkpoint, following its source recipe.

Recipes (``Weight.source``) are small JSON-able trees written by the lowering and the passes:

    ["ckpt", name]              the checkpoint tensor (read alone, converted to fp32)
    ["reshape", [dims], r]      same elements, new shape
    ["concat", axis, r1, r2..]  concatenation (passes/fuse.py merges sibling projections)
    ["cast", dtype, r]          to bf16 / f16 / f32 (passes/quantize.py)
    ["q4", group, r]            packed int4 + f16 scales (layout in kernels/matvec.py)
    ["groups", G, [s0, s1..], [p0, p1..], r]
                                r's rows as G groups of s0 + s1 + .. rows, each group split into parts of
                                those sizes; the result is part p0 of every group (in group order), then
                                part p1 of every group, ... (Qwen3-Next's in_proj_qkvz / in_proj_ba are
                                interleaved per key-head group: compiler/qwen3_5.py gdn_projection_source)
    ["experts", pattern, E]     the E checkpoint tensors pattern.replace("*", e), stacked along rows (a
                                mixture-of-experts layer's experts as one [E * rows, cols] matrix)

Only the tensors one weight needs are in memory at a time. A q4 matrix is quantised in bands of rows
(its rows quantise independently), so the quantiser's temporaries stay small beside the matrix.
"""
from __future__ import annotations

import torch

from kestrel.compiler.ir import Weight, is_q4
from kestrel.kernels.matvec import q4_pack

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def evaluate(recipe: list, read) -> torch.Tensor:
    """``read(name)`` loads one checkpoint tensor."""
    op = recipe[0]
    if op == "ckpt":
        return read(recipe[1]).to(torch.float32)
    if op == "reshape":
        return evaluate(recipe[2], read).reshape(recipe[1])
    if op == "concat":
        return torch.cat([evaluate(r, read) for r in recipe[2:]], dim=recipe[1])
    if op == "cast":
        return evaluate(recipe[2], read).to(TORCH_DTYPES[recipe[1]])
    if op == "q4":
        return _q4_pack_bands(evaluate(recipe[2], read), recipe[1])
    if op == "groups":
        groups, sizes, parts, t = recipe[1], recipe[2], recipe[3], evaluate(recipe[4], read)
        t = t.reshape(groups, sum(sizes), *t.shape[1:])
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return torch.cat([t[:, starts[i]:starts[i] + sizes[i]].reshape(-1, *t.shape[2:]) for i in parts])
    if op == "experts":
        pattern, n = recipe[1], recipe[2]
        first = read(pattern.replace("*", "0")).to(torch.float32)
        out = torch.empty((n * first.shape[0], *first.shape[1:]), dtype=torch.float32)
        rows = first.shape[0]
        out[:rows] = first
        del first
        for e in range(1, n):
            out[e * rows:(e + 1) * rows] = read(pattern.replace("*", str(e)))
        return out
    raise ValueError(f"unknown weight recipe {op!r}")


# ~1M weights a band: the quantiser's passes over a band stay in cache (this 2-core machine: ~100 M weights/s
# against 41 M/s at 16M a band; q4_quantize itself went from 6 M/s to that in stop 45)
Q4_BAND_ELEMENTS = 1 << 20


def _q4_pack_bands(w: torch.Tensor, group: int) -> torch.Tensor:
    """q4_pack of w [N, K], made band by band of rows (the same bytes: rows quantise independently)."""
    n, k = w.shape
    band = max(1, Q4_BAND_ELEMENTS // k)
    if n <= band:
        return q4_pack(w, group)
    words, scales = [], []
    for lo in range(0, n, band):
        packed = q4_pack(w[lo:lo + band], group)
        rows = min(band, n - lo)
        words.append(packed[:rows * k // 2])
        scales.append(packed[rows * k // 2:])
    return torch.cat(words + scales)


def weight_bytes(w: Weight, read) -> memoryview:
    """The bytes the plan stores for ``w``: its type's layout, checked against its declared size."""
    t = evaluate(w.source, read)
    if not is_q4(w.type.dtype):
        if tuple(t.shape) != w.type.shape:
            raise ValueError(f"weight {w.name}: recipe gives {list(t.shape)}, declared {list(w.type.shape)}")
        t = t.to(TORCH_DTYPES[w.type.dtype])
    data = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    if data.nbytes != w.type.nbytes:
        raise ValueError(f"weight {w.name}: {data.nbytes} bytes, its type {w.type} needs {w.type.nbytes}")
    return memoryview(data)


def storage(w: Weight) -> tuple[str, tuple]:
    """(container dtype, shape) a weight is stored under in the .plan."""
    if is_q4(w.type.dtype):
        return "u8", (w.type.nbytes,)
    return w.type.dtype, w.type.shape
