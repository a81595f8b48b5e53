"""Embedding gather: the row of the table for the token id held in the dyn buffer; at M rows, the
rows of the prompt chunk's token ids (read from the token sequence). On the GPU the one-token gather runs
as ``embedding_rmsnorm``, with the norm after it in the same program (passes/fuse.py: every embedding of a
step feeds an RMSNorm, the first layer's or the MTP head's)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.rmsnorm import _rmsnorm_row, rmsnorm_ref
from kestrel.kernels.targets import pow2_at_least


def embedding_ref(table: torch.Tensor, token: int) -> torch.Tensor:
    return table[token].float()


def embedding_rmsnorm_ref(table: torch.Tensor, token: int, w: torch.Tensor, eps: float):
    """(x, rmsnorm(x)) with x = table[token] as fp32: the step's residual stream and the first layer's normed
    input, as the two references compose them."""
    x = embedding_ref(table, token)
    return x, rmsnorm_ref(x, w, eps)


def embedding_rmsnorm_launch(hidden: int, target) -> dict:
    """One program for the whole row (BLOCK = H rounded up to a power of two), the rmsnorm kernel's warps
    (``target.rules["rmsnorm"]``: its one-program norm, now with the gather before it)."""
    r = target.rules["rmsnorm"]
    return {"grid": [1, 1, 1], "num_warps": r.wide_warps if hidden >= r.wide_n else r.num_warps,
            "constexprs": {"H": hidden, "BLOCK": pow2_at_least(hidden)}}


@triton.jit
def embedding_rmsnorm_kernel(table_ptr, token_ptr, w_ptr, x_ptr, out_ptr, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
    """x = table[token] as fp32 and out = rmsnorm(x) (rmsnorm_kernel's arithmetic on the row in registers): the
    gather and the first layer's norm without the norm's own launch (H200, stop 41 call 3: 0.8B q4 0.4691 ->
    0.4678 ms/token, bf16 0.7133 -> 0.7119; stop 40's --profile had put the lone norm at 6-12 us in the graph)."""
    pdl_wait(PDL)
    tok = tl.load(token_ptr).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(table_ptr + tok * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + cols, x, mask=mask)
    tl.store(out_ptr + cols, _rmsnorm_row(x, w_ptr, cols, mask, eps, H), mask=mask)


def embedding_rows_ref(table: torch.Tensor, tokens: torch.Tensor, pos: int, n_prompt: int, rows: int) -> torch.Tensor:
    """The M-row step's input: row r is the embedding of tokens[pos + r] while pos + r < n_prompt (the
    chunk's valid rows), zeros after."""
    out = torch.zeros(rows, table.shape[1], dtype=torch.float32)
    for r in range(max(0, min(rows, n_prompt - pos))):
        out[r] = embedding_ref(table, int(tokens[pos + r]))
    return out


def embedding_rows_launch(rows: int, hidden: int, max_seq: int, target) -> dict:
    """Grid [rows, H / BLOCK], BLOCK and warps from ``target.rules["embedding"]`` (sm_90: 1024, 4)."""
    r = target.rules["embedding"]
    return {"grid": [rows, (hidden + r.block - 1) // r.block, 1], "num_warps": r.num_warps,
            "constexprs": {"H": hidden, "S": max_seq, "BLOCK": r.block}}


@triton.jit
def embedding_rows_kernel(table_ptr, tokens_ptr, pos_ptr, n_prompt_ptr, out_ptr, rows, H: tl.constexpr,
                          S: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``embedding_rows_ref``: program (r, c) writes columns c * BLOCK.. of row r: the table row of
    tokens[pos + r] while pos + r < n_prompt, zeros after (the index clamped into the sequence)."""
    pdl_wait(PDL)
    r = tl.program_id(0)
    p = tl.load(pos_ptr) + r
    valid = p < tl.load(n_prompt_ptr)
    tok = tl.load(tokens_ptr + tl.minimum(tl.maximum(p, 0), S - 1)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    row = tl.load(table_ptr + tok * H + offs, mask=mask & valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * H + offs, row, mask=mask)


def embedding_next_rows_ref(table: torch.Tensor, tokens: torch.Tensor, pos: int, bound: int, sampled: int,
                            rows: int) -> torch.Tensor:
    """The MTP head's token input over the rows of an M-row pass (``--speculative mtp``): row r (position
    pos + r, valid while pos + r < bound) embeds the token that FOLLOWS it: tokens[pos + r + 1] while
    pos + r + 1 < bound, else (the bound's last row) ``sampled``, the token the step has just chosen
    there; zeros on invalid rows."""
    out = torch.zeros(rows, table.shape[1], dtype=torch.float32)
    s = tokens.numel()
    for r in range(max(0, min(rows, bound - pos))):
        nxt = pos + r + 1
        out[r] = embedding_ref(table, int(tokens[min(max(nxt, 0), s - 1)]) if nxt < bound else sampled)
    return out


@triton.jit
def embedding_next_rows_kernel(table_ptr, tokens_ptr, pos_ptr, bound_ptr, sampled_ptr, out_ptr, rows,
                               H: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``embedding_next_rows_ref`` (``embedding_rows_launch``'s grid): program (r, c) writes columns
    c * BLOCK.. of row r."""
    pdl_wait(PDL)
    r = tl.program_id(0)
    nxt = tl.load(pos_ptr) + r + 1
    bound = tl.load(bound_ptr)
    seq = tl.load(tokens_ptr + tl.minimum(tl.maximum(nxt, 0), S - 1))
    tok = tl.where(nxt < bound, seq, tl.load(sampled_ptr)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    row = tl.load(table_ptr + tok * H + offs, mask=mask & (nxt - 1 < bound), other=0.0).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * H + offs, row, mask=mask)
