"""The speculative iteration's decisions, made on the device (greedy; kestrel's ``--speculative mtp``).

An iteration (compiler/qwen3_5.py, ``lower_speculative``) starts at position pos with tokens[pos] the
last accepted token and tokens[pos + 1 .. pos + K] the K drafts of the previous iteration (or of the
prefill), verifies the K + 1 rows pos .. pos + K in one M-row pass of the target model, and then:

* ``spec_begin_ref``: vend = pos + K + 1, the verify's row bound (rows pos + r < vend are valid);
* ``argmax_rows_ref``: the target's greedy choice at every verified row (the first index among equal
  maxima, as ``sample_ref`` at temperature 0);
* ``accept_ref``: the longest prefix of drafts equal to the target's choices, plus the target's own
  next token: a drafts accepted (0 .. K), tokens[pos + a + 1] = the target's token at row a (the
  accepted drafts already sit at pos + 1 .. pos + a), npos = pos + a + 1 (the next iteration's
  position), dpos = pos + a (the position the next draft chain starts from), sampled = that token;
* ``draft_end_ref``: after each draft of the MTP head, the draft is written at tokens[dpos + 2] (the
  position it predicts; never a prompt position) and dpos advances;
* ``spec_end_ref``: pos = npos, token = the accepted next token: where the one-token step would be.

Every index into the token sequence is clamped into it (the host keeps iterations where they fit).
Kernels: one program each (a handful of scalars), except ``argmax_rows``: one program per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.targets import pow2_at_least


def _clamp(i: int, n: int) -> int:
    return min(max(i, 0), n - 1)


def spec_begin_ref(pos: int, rows: int) -> int:
    """vend: the bound of the verify's rows (pos + r < vend for r < rows)."""
    return pos + rows


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [R, V]: the first index among equal maxima (i32[R])."""
    return torch.argmax(logits.float(), dim=-1).to(torch.int32)


def accept_ref(targets: torch.Tensor, pos: int, tokens: torch.Tensor) -> tuple[int, int, int, int]:
    """Greedy acceptance of the drafts tokens[pos + 1 .. pos + K] against the target's choices
    targets[0 .. K] (targets[i]: the target's token after row pos + i). Returns (npos, dpos, sampled,
    accepted) and writes tokens[pos + accepted + 1] = sampled (in place)."""
    k, s = targets.numel() - 1, tokens.numel()
    a = 0
    while a < k and int(tokens[_clamp(pos + 1 + a, s)]) == int(targets[a]):
        a += 1
    t = int(targets[a])
    tokens[_clamp(pos + a + 1, s)] = t
    return pos + a + 1, pos + a, t, a


def draft_end_ref(dpos: int, draft: int, n_prompt: int, tokens: torch.Tensor) -> int:
    """A draft made at position dpos predicts the token at dpos + 2: written there unless that is a
    prompt position (a prefill chunk that does not end the prompt drafts in vain). Returns dpos + 1."""
    at = dpos + 2
    if at > n_prompt:
        tokens[_clamp(at, tokens.numel())] = draft
    return dpos + 1


def spec_end_ref(npos: int, sampled: int) -> tuple[int, int]:
    """(pos, token) for the next step: the position after the accepted tokens and the token there."""
    return npos, sampled


def scalar_launch(target) -> dict:
    """spec_begin / accept / draft_end / spec_end: one program of ``target.rules["step_end"]``'s warps."""
    return {"grid": [1, 1, 1], "num_warps": target.rules["step_end"].num_warps, "constexprs": {}}


def argmax_rows_launch(rows: int, vocab: int, target) -> dict:
    """One program per row, each scanning the row in slices of BLOCK (``target.rules["speculative"]``)."""
    r = target.rules["speculative"]
    return {"grid": [rows, 1, 1], "num_warps": r.num_warps,
            "constexprs": {"V": vocab, "BLOCK": min(r.block, pow2_at_least(vocab))}}


@triton.jit
def spec_begin_kernel(pos_ptr, vend_ptr, rows, PDL: tl.constexpr = False):
    """``spec_begin_ref``."""
    pdl_wait(PDL)
    tl.store(vend_ptr, tl.load(pos_ptr) + rows)


@triton.jit
def argmax_rows_kernel(logits_ptr, out_ptr, V: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``argmax_rows_ref``: program r scans row r slice by slice, keeping the largest value and its
    first index (a later slice replaces it only when strictly larger: the first index among ties)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(logits_ptr + r * V + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, idx, V), axis=0)
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + r, best_i)


@triton.jit
def accept_kernel(targets_ptr, pos_ptr, tokens_ptr, npos_ptr, dpos_ptr, sampled_ptr, accepted_ptr,
                  R: tl.constexpr, S: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """``accept_ref``: one program; the drafts are read before the one write to the sequence."""
    pdl_wait(PDL)
    pos = tl.load(pos_ptr)
    i = tl.arange(0, BLOCK_R)
    t = tl.load(targets_ptr + i, mask=i < R, other=0)
    d = tl.load(tokens_ptr + tl.minimum(tl.maximum(pos + 1 + i, 0), S - 1), mask=i < R - 1, other=0)
    a = tl.min(tl.where((i < R - 1) & (t != d), i, R - 1), axis=0)
    tok = tl.sum(tl.where(i == a, t, 0), axis=0)
    tl.store(tokens_ptr + tl.minimum(tl.maximum(pos + a + 1, 0), S - 1), tok)
    tl.store(npos_ptr, pos + a + 1)
    tl.store(dpos_ptr, pos + a)
    tl.store(sampled_ptr, tok)
    tl.store(accepted_ptr, a)


@triton.jit
def draft_end_kernel(dpos_ptr, draft_ptr, n_prompt_ptr, tokens_ptr, dpos_out_ptr, S: tl.constexpr,
                     PDL: tl.constexpr = False):
    """``draft_end_ref`` (dpos read before it is advanced in place)."""
    pdl_wait(PDL)
    dpos = tl.load(dpos_ptr)
    at = dpos + 2
    tl.store(tokens_ptr + tl.minimum(tl.maximum(at, 0), S - 1), tl.load(draft_ptr), mask=at > tl.load(n_prompt_ptr))
    tl.store(dpos_out_ptr, dpos + 1)


@triton.jit
def spec_end_kernel(npos_ptr, sampled_ptr, pos_ptr, token_ptr, PDL: tl.constexpr = False):
    """``spec_end_ref``."""
    pdl_wait(PDL)
    tl.store(pos_ptr, tl.load(npos_ptr))
    tl.store(token_ptr, tl.load(sampled_ptr))
