"""Embedding gather: the row of the table for the token id held in the dyn buffer; at M rows, the
rows of the prompt chunk's token ids (read from the token sequence)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_wait


def embedding_ref(table: torch.Tensor, token: int) -> torch.Tensor:
    return table[token].float()


def embedding_launch(hidden: int, target) -> dict:
    """H / BLOCK programs; BLOCK and num_warps from ``target.rules["embedding"]`` (sm_90: 1024, 4)."""
    r = target.rules["embedding"]
    return {"grid": [(hidden + r.block - 1) // r.block, 1, 1], "num_warps": r.num_warps,
            "constexprs": {"H": hidden, "BLOCK": r.block}}


@triton.jit
def embedding_kernel(table_ptr, token_ptr, out_ptr, H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out = table[token] as fp32; the token id is read from the dyn buffer. Grid: H / BLOCK."""
    pdl_wait(PDL)
    tok = tl.load(token_ptr).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    row = tl.load(table_ptr + tok * H + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, row, mask=mask)


def embedding_rows_ref(table: torch.Tensor, tokens: torch.Tensor, pos: int, n_prompt: int, rows: int) -> torch.Tensor:
    """The M-row step's input: row r is the embedding of tokens[pos + r] while pos + r < n_prompt (the
    chunk's valid rows), zeros after."""
    out = torch.zeros(rows, table.shape[1], dtype=torch.float32)
    for r in range(max(0, min(rows, n_prompt - pos))):
        out[r] = embedding_ref(table, int(tokens[pos + r]))
    return out


def embedding_rows_launch(rows: int, hidden: int, max_seq: int, target) -> dict:
    """Grid [rows, H / BLOCK] with the one-token gather's BLOCK and warps (``target.rules["embedding"]``)."""
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
