"""Making a plan weight's bytes from the checkpoint, following its source recipe.

Recipes (``Weight.source``) are small JSON-able trees written by the lowering and the passes:

    ["ckpt", name]              the checkpoint tensor (read alone, converted to fp32)
    ["reshape", [dims], r]      same elements, new shape
    ["concat", axis, r1, r2..]  concatenation (passes/fuse.py merges sibling projections)
    ["cast", dtype, r]          to bf16 / f16 / f32 (passes/quantize.py)
    ["q4", group, r]            packed int4 + f16 scales (layout in kernels/matvec.py)

Only the tensors one weight needs are in memory at a time.
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
        return q4_pack(evaluate(recipe[2], read), recipe[1])
    raise ValueError(f"unknown weight recipe {op!r}")


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
