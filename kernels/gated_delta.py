"""Gated DeltaNet decode step (one token), state in fp32.

* ``conv1d_step_ref``: depthwise causal conv of kernel K over [last K-1 inputs | x], then SiLU;
  the state keeps the last K-1 inputs, oldest first;
* ``gdn_gates_ref``: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b);
* ``gated_delta_step_ref``: per value head j (reading key head j // (Hv / Hk)):
  S = S * exp(g); S += k (outer) beta * (v - S^T k); o = S^T (q * scale).

Fused forms (made by passes/fuse.py), each composing the references above in the same order:
* ``gdn_delta``: conv (reading, not shifting, the conv state) + SiLU, split q|k|v, L2 norms, gates,
  delta rule -> o_raw [Hv * Dv]; one program per (value head, column block of Dv);
* ``gdn_norm``: gated RMSNorm of o_raw per value head, and the conv-state shift (x appended);
* ``gdn_step``: both as one op (valid IR with a CPU reference; no GPU kernel: one kernel doing both
  needs one program per key head to update the conv state race-free — 16 programs at 27B, 6.8% of
  bandwidth measured — so fuse emits the pair instead).

M-row (prefill) forms over the M projection rows x [M, W] of a prompt chunk (rows past the prompt's
end are invalid: zero outputs, states untouched):
* ``gdn_rows_delta``: ``gdn_rows_delta_ref``, each valid row in order as ``gdn_delta`` runs one token
  (the conv state only read); one program per (value head, column block) keeps its state tile in
  registers over all the rows: row by row (exact fp32 recurrence) or, by the CHUNK constexpr, in
  chunks of 16 to 64 rows (the chunk-parallel WY form on tensor cores, TF32 products);
* ``gdn_rows_norm``: ``gdn_rows_norm_ref``, the gated RMSNorm of every row and the conv state
  advanced by the valid rows.

The speculative verify (``--speculative mtp``: K + 1 rows, K <= 4) runs the same two kernels, leaving the
recurrent state as it was: ``gdn_rows_delta_snap`` computes every row from the state in registers and stores,
instead of the state, each row's update (``update_row_width``: the decay exp(g) per value head, the normalised
keys, the delta rule's beta * (v - S^T k) per state column) into a per-layer state ``recurrent_rows``
[K + 1, ...]; ``gdn_rows_norm_snap`` advances the conv windows and stores the window after each row but the
last into ``conv_snap`` (``gdn_rows_snap_ref``). Once the drafts are accepted, ``gdn_commit`` advances the
recurrent state by the kept rows' updates (S = S * decay + k (outer) delta per row: the verify's own arithmetic,
so the state equals the one-token step's after those tokens, bit for bit) and brings the conv window back to the
last kept row's (``gdn_commit_ref``). The recompute costs the state's one read and write a layer, as the
one-token step does, where per-row snapshots of the state cost K writes in the verify and a copy on rejection
(27B: 157 MB of state a snapshot, stop 39).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.kernels.elementwise import l2norm_ref
from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.rmsnorm import gated_rmsnorm_ref
from kestrel.kernels.targets import fp_fusion, pow2_at_least


def gdn_key_heads(channels: int, hv: int, dk: int, dv: int) -> int:
    """Key heads of a Gated DeltaNet layer from its conv channels (q | k | v = 2 * Hk * Dk + Hv * Dv).
    Not an integer split (or not a divisor of Hv) means the shapes are wrong: returns 0 then."""
    qk = channels - hv * dv
    if qk <= 0 or qk % (2 * dk) or hv % (qk // (2 * dk)):
        return 0
    return qk // (2 * dk)


def _conv_window_ref(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return torch.cat([state, x[:, None].to(state.dtype)], dim=1)  # [C, K], oldest first


def conv1d_ref(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, act: str) -> torch.Tensor:
    """The conv output of ``conv1d_step_ref`` without touching the state."""
    out = (_conv_window_ref(x, state) * w.float()).sum(dim=1)
    return F.silu(out) if act == "silu" else out


def conv_shift_ref(x: torch.Tensor, state: torch.Tensor) -> None:
    """The state update of ``conv1d_step_ref``: shift left by one, append x as the newest column."""
    state.copy_(_conv_window_ref(x, state)[:, 1:])


def conv1d_step_ref(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, act: str) -> torch.Tensor:
    """x [C], state [C, K-1] (updated in place), w [C, K]."""
    out = conv1d_ref(x, state, w, act)
    conv_shift_ref(x, state)
    return out


def gdn_gates_ref(a, b, a_log, dt_bias):
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def update_row_width(hk: int, hv: int, dk: int, dv: int) -> int:
    """The f32 values of one row's state update (``gated_delta_step_ref``'s ``record``): the decay exp(g) [Hv],
    the normalised keys [Hk, Dk], the delta rule's delta = beta * (v - S^T k) [Hv, Dv], in that order."""
    return hv + hk * dk + hv * dv


def update_row_keys(width: int, hv: int, dk: int, dv: int) -> int:
    """The key heads Hk of a row update of ``width`` values (``update_row_width``'s inverse)."""
    return (width - hv - hv * dv) // dk


def _add_update(s: torch.Tensor, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The decayed state s plus k (outer) delta per value head (k [Hv, Dk], repeated over the value heads)."""
    return s + k[:, :, None] * delta[:, None, :]


def gated_delta_step_ref(q, k, v, g, beta, state: torch.Tensor, scale: float,
                         record: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [Hk, Dk]; v [Hv, Dv]; g, beta [Hv]; state [Hv, Dk, Dv] fp32, updated in place. ``record`` (f32
    [update_row_width]): the update's decay, keys and delta written there (``gdn_commit_ref`` applies it)."""
    rep = v.shape[0] // q.shape[0]
    q = q.float().repeat_interleave(rep, dim=0) * scale  # [Hv, Dk]
    kh = k.float()
    k = kh.repeat_interleave(rep, dim=0)
    decay = g.exp()
    s = state * decay[:, None, None]
    kv_mem = (s * k[:, :, None]).sum(dim=1)  # S^T k: [Hv, Dv]
    delta = (v.float() - kv_mem) * beta[:, None]
    s = _add_update(s, k, delta)
    state.copy_(s)
    if record is not None:
        record.copy_(torch.cat([decay, kh.reshape(-1), delta.reshape(-1)]))
    return (s * q[:, :, None]).sum(dim=1)


def gdn_step_ref(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec_state, eps: float, l2_eps: float,
                 scale: float) -> torch.Tensor:
    """The whole Gated DeltaNet token mixer after its input projections, as one step: conv1d update
    + SiLU, split q|k|v, L2-normalise q and k, gates, delta rule, gated RMSNorm — ``gdn_delta_ref``
    then ``gdn_norm_ref`` (tests check that pair against the single-op references bit for bit)."""
    o_raw = gdn_delta_ref(qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec_state, l2_eps, scale)
    return gdn_norm_ref(o_raw, z, qkv, norm_w, conv_state, eps)


def gdn_delta_ref(qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec_state, l2_eps: float,
                  scale: float, record: torch.Tensor | None = None) -> torch.Tensor:
    """First half of ``gdn_step_ref``: conv + SiLU (conv_state only read), split q|k|v, L2 norms,
    gates, delta rule (rec_state updated in place; ``record``: ``gated_delta_step_ref``'s). Returns o_raw
    [Hv * Dv], before the norm."""

    hv, dk, dv = rec_state.shape
    hk = gdn_key_heads(qkv.shape[0], hv, dk, dv)
    mixed = conv1d_ref(qkv, conv_state, conv_w, "silu")
    q = l2norm_ref(mixed[: hk * dk].reshape(hk, dk), l2_eps)
    k = l2norm_ref(mixed[hk * dk: 2 * hk * dk].reshape(hk, dk), l2_eps)
    v = mixed[2 * hk * dk:].reshape(hv, dv)
    g, beta = gdn_gates_ref(a, b, a_log, dt_bias)
    return gated_delta_step_ref(q, k, v, g, beta, rec_state, scale, record).reshape(hv * dv)


def gdn_rows_ref(qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec_state, pos: int, n_prompt: int,
                 l2_eps: float, scale: float) -> torch.Tensor:
    """The Gated DeltaNet mixer over the M rows of a prompt chunk (before its gated norm): each valid
    row (pos + r < n_prompt) in order, exactly as the one-token step runs it (conv over the window,
    delta rule on the fp32 state; both states advanced), invalid rows left zero and the states
    untouched by them. Returns o_raw [M, Hv * Dv]. (The GPU kernel computes the same recurrence row
    by row, or in its chunk-parallel form.)"""
    rows = qkv.shape[0]
    hv, _, dv = rec_state.shape
    out = torch.zeros(rows, hv * dv, dtype=torch.float32)
    for r in range(max(0, min(rows, n_prompt - pos))):
        out[r] = gdn_delta_ref(qkv[r], b[r], a[r], conv_state, conv_w, a_log, dt_bias, rec_state, l2_eps, scale)
        conv_shift_ref(qkv[r], conv_state)
    return out


def gdn_rows_delta_ref(x, conv_state, conv_w, a_log, dt_bias, rec_state, pos: int, n_prompt: int, qkv: int, b: int,
                       a: int, l2_eps: float, scale: float) -> torch.Tensor:
    """First half of ``gdn_rows_ref`` on the projection rows x [M, W] (columns qkv .. qkv + C are the
    conv channels, b .. b + Hv and a .. a + Hv the gates' inputs): the same recurrence over the valid
    rows, rec_state advanced, conv_state only read (each row's conv window is the state, then the
    chunk's earlier rows). Returns o_raw [M, Hv * Dv], zero on invalid rows."""
    hv = rec_state.shape[0]
    c = conv_w.shape[0]
    return gdn_rows_ref(x[:, qkv:qkv + c], x[:, b:b + hv], x[:, a:a + hv], conv_state.clone(), conv_w, a_log,
                        dt_bias, rec_state, pos, n_prompt, l2_eps, scale)


def gdn_rows_norm_ref(o_raw, x, norm_w, conv_state, pos: int, n_prompt: int, z: int, qkv: int,
                      eps: float) -> torch.Tensor:
    """Second half: the gated RMSNorm of every row of o_raw [M, Hv * Dv] per value head with z =
    x[:, z .. z + Hv * Dv], and the conv state shifted by the chunk's valid rows' raw inputs
    x[:, qkv .. qkv + C] (after this the state holds the last K-1 inputs up to the chunk's last valid row)."""
    rows, n = o_raw.shape
    dv = norm_w.shape[0]
    out = gated_rmsnorm_ref(o_raw.reshape(rows, n // dv, dv), x[:, z:z + n].reshape(rows, n // dv, dv), norm_w,
                            eps).reshape(rows, n)
    c = conv_state.shape[0]
    for r in range(max(0, min(rows, n_prompt - pos))):
        conv_shift_ref(x[r, qkv:qkv + c], conv_state)
    return out


def gdn_rows_snap_ref(qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec_state, pos: int, n_prompt: int, rec_rows,
                      conv_snap, l2_eps: float, scale: float) -> torch.Tensor:
    """``gdn_rows_ref`` for the speculative verify, leaving the recurrent state as it was: the same rows, each
    valid row r's state update written to rec_rows[r] ([M, update_row_width]), and the conv window after each
    valid row r < M - 1 copied into conv_snap[r] ([M - 1, C, K - 1]; the conv state is advanced by all valid
    rows): what ``gdn_commit_ref`` needs to leave both states after the kept rows."""
    rows = qkv.shape[0]
    hv, _, dv = rec_state.shape
    state = rec_state.clone()
    out = torch.zeros(rows, hv * dv, dtype=torch.float32)
    for r in range(max(0, min(rows, n_prompt - pos))):
        out[r] = gdn_delta_ref(qkv[r], b[r], a[r], conv_state, conv_w, a_log, dt_bias, state, l2_eps, scale,
                               rec_rows[r])
        conv_shift_ref(qkv[r], conv_state)
        if r < rows - 1:
            conv_snap[r] = conv_state
    return out


def gdn_rows_delta_snap_ref(x, conv_state, conv_w, a_log, dt_bias, rec_state, pos: int, n_prompt: int, rec_rows,
                            qkv: int, b: int, a: int, l2_eps: float, scale: float) -> torch.Tensor:
    """``gdn_rows_delta_ref`` writing the rows' updates of ``gdn_rows_snap_ref`` (both states only read; the conv
    snapshots are ``gdn_rows_norm_snap_ref``'s)."""
    hv = rec_state.shape[0]
    c = conv_w.shape[0]
    scratch = torch.zeros((rec_rows.shape[0] - 1,) + tuple(conv_state.shape), dtype=conv_state.dtype)
    return gdn_rows_snap_ref(x[:, qkv:qkv + c], x[:, b:b + hv], x[:, a:a + hv], conv_state.clone(), conv_w, a_log,
                             dt_bias, rec_state, pos, n_prompt, rec_rows, scratch, l2_eps, scale)


def gdn_rows_norm_snap_ref(o_raw, x, norm_w, conv_state, pos: int, n_prompt: int, conv_snap, z: int, qkv: int,
                           eps: float) -> torch.Tensor:
    """``gdn_rows_norm_ref`` writing the conv window after each valid row r < M - 1 into conv_snap[r]."""
    rows = o_raw.shape[0]
    c = conv_state.shape[0]
    before = conv_state.clone()
    out = gdn_rows_norm_ref(o_raw, x, norm_w, conv_state, pos, n_prompt, z, qkv, eps)
    for r in range(max(0, min(rows - 1, n_prompt - pos))):
        conv_shift_ref(x[r, qkv:qkv + c], before)
        conv_snap[r] = before
    return out


def gdn_commit_ref(rec_state, rec_rows, conv_state, conv_snap, pos: int, npos: int) -> None:
    """After the verify of M rows: kept = npos - pos rows were accepted. The recurrent state advances by the
    updates of rows 0 .. kept - 1 (each S = S * decay + k (outer) delta, as ``gated_delta_step_ref`` made it, so
    the state is the one after those tokens bit for bit); the conv window goes back to snapshot kept - 1 unless
    all M rows were kept (it already stands after them)."""
    hv, dk, dv = rec_state.shape
    hk = update_row_keys(rec_rows.shape[1], hv, dk, dv)
    kept = npos - pos
    for r in range(max(0, min(kept, rec_rows.shape[0]))):
        row = rec_rows[r]
        k = row[hv:hv + hk * dk].reshape(hk, dk).repeat_interleave(hv // hk, dim=0)
        rec_state.copy_(_add_update(rec_state * row[:hv, None, None], k, row[hv + hk * dk:].reshape(hv, dv)))
    if 1 <= kept <= conv_snap.shape[0]:
        conv_state.copy_(conv_snap[kept - 1])


def gdn_norm_ref(o_raw, z, qkv, norm_w, conv_state, eps: float) -> torch.Tensor:
    """Second half of ``gdn_step_ref``: gated RMSNorm per value head, then the conv-state shift."""

    dv = norm_w.shape[0]
    hv = o_raw.shape[0] // dv
    out = gated_rmsnorm_ref(o_raw.reshape(hv, dv), z.reshape(hv, dv), norm_w, eps).reshape(hv * dv)
    conv_shift_ref(qkv, conv_state)
    return out


def gdn_delta_launch(hk: int, hv: int, dk: int, dv: int, kc: int, target) -> dict:
    """Grid [Hv, Dv / BLOCK_V]: one program per (value head, block of BLOCK_V state columns); the
    delta rule is independent per column of S. Constants from ``target.rules["gdn_delta"]``
    (kernels/targets.py); on sm_90: 8 columns and one warp a program (768 programs at Hv = 48, 256 at the
    0.8B's Hv = 16): the kernel is latency-bound, so more, smaller programs, whose reductions over Dk stay
    inside a warp, beat 32 columns with 4 warps (the H200 sweep of stop 24, bench/gdn_sweep.sh: Qwen3-Next
    22.6 against 25.9 us a step for 3 layers, 0.8B 121 against 143 us). The [BLOCK_DK, BLOCK_V] tile is
    32 fp32 per thread at Dk = 128."""

    r = target.rules["gdn_delta"]
    bdk = pow2_at_least(dk)
    block_v = min(r.max_block_v, max(r.min_block_v, pow2_at_least(dv) // r.block_v_div))
    return {"grid": [hv, -(-dv // block_v), 1], "num_warps": r.num_warps, **fp_fusion(r.fp_fusion),
            "constexprs": {"HK": hk, "HV": hv, "DK": dk, "DV": dv, "KC": kc, "BLOCK_DK": bdk, "BLOCK_V": block_v,
                           "PRELOAD": r.preload}}


def gdn_norm_launch(hv: int, dv: int, channels: int, kc: int, target) -> dict:
    """Grid [Hv]: program j normalises value head j and shifts conv-state channels
    [j * CH_PER_PROG, (j + 1) * CH_PER_PROG) of all ``channels`` (q, k and v alike).
    num_warps: ``target.rules["gdn_norm"]`` (4 on sm_90); compiled with or without FMA contraction as gdn_delta
    (``target.rules["gdn_delta"].fp_fusion``), its twin at a verify's rows being ``gdn_rows_norm_snap_kernel``."""

    per = -(-channels // hv)
    return {"grid": [hv, 1, 1], "num_warps": target.rules["gdn_norm"].num_warps,
            **fp_fusion(target.rules["gdn_delta"].fp_fusion),
            "constexprs": {"HV": hv, "DV": dv, "C": channels, "KC": kc, "BLOCK_DV": pow2_at_least(dv),
                           "CH_PER_PROG": per, "BLOCK_CH": pow2_at_least(per)}}


def gdn_rows_delta_launch(rows: int, width: int, hk: int, hv: int, dk: int, dv: int, kc: int, target,
                          chunk: int | None = None, snap: bool = False) -> dict:
    """``gdn_rows_delta_kernel`` over a chunk of ``rows`` projection rows of ``width`` columns: grid
    [Hv, Dv / BLOCK_V], one program per (value head, block of BLOCK_V state columns), each looping
    over the valid rows with its state tile in registers. ``chunk``: 0 for the row-by-row form
    (exact fp32), 16 / 32 / 64 for the chunk-parallel form with that many rows a step (TF32
    products); by default the rule's chunk when the row-by-row grid has fewer than
    ``row_min_programs`` programs, else row by row (sm_90: 256, measured at M = 256 on the H200,
    bench/results/stop17/prefill-big.json: 0.8B, 128 programs, 3.1 ms a chunk in chunks of 16 vs
    5.5 ms row by row; 27B, 384 programs, 25.1 vs 17.8 ms). Constants from
    ``target.rules["gdn_rows"]`` (kernels/targets.py). Row by row the loop is latency-bound, so its
    blocks are narrow, for many programs at once, and one warp each, so that the per-row reductions
    over Dk need no barrier (sm_90: 8 columns, 1 warp: 768 programs at 27B, 512 at Qwen3-Next, 256 at
    0.8B; stop 24's sweep, bench/gdn_sweep.sh: Qwen3-Next 0.49 against 1.05 ms a 256-row run for 3
    layers with 16 columns and 4 warps; 0.8B 2.96 ms row by row against 3.12 in chunks). The chunked form's tensor-core
    products need BLOCK_V >= 16 (sm_90: 16 columns, 8 warps; at Dk = 128 its 16-row chunks compile
    with almost no register spills, 32- and 64-row chunks spill kilobytes). ``snap``: the launch of
    ``gdn_rows_delta_snap_kernel`` (row by row), compiled with or without FMA contraction as ``gdn_delta`` is
    (``target.rules["gdn_delta"].fp_fusion``), its rows being the one-token step's."""
    r = target.rules["gdn_rows"]
    if snap and chunk != 0:
        raise ValueError("gdn_rows_delta_snap: its snapshots are taken row by row (chunk 0)")
    row_block_v = min(r.max_block_v, max(r.min_block_v, pow2_at_least(dv) // r.block_v_div))
    if chunk is None:  # row by row needs many programs to hide its per-row latency; chunks of rows otherwise
        chunk = r.chunk if hv * -(-dv // row_block_v) < r.row_min_programs else 0
    if chunk:
        if chunk not in (16, 32, 64):
            raise ValueError(f"gdn_rows_delta: chunk of {chunk} rows (16, 32 or 64, or 0 for row by row)")
        block_v, num_warps = max(16, min(r.chunk_block_v, pow2_at_least(dv))), r.chunk_num_warps
    else:
        if not 2 <= kc <= 4:
            raise ValueError(f"gdn_rows_delta: a conv of {kc} taps (the row-by-row form takes 2 to 4)")
        block_v, num_warps = row_block_v, r.num_warps
    return {"grid": [hv, -(-dv // block_v), 1], "num_warps": num_warps,
            **(fp_fusion(target.rules["gdn_delta"].fp_fusion) if snap else {}),
            "constexprs": {"M": rows, "W": width, "HK": hk, "HV": hv, "DK": dk, "DV": dv, "KC": kc,
                           "BLOCK_DK": max(16, pow2_at_least(dk)), "BLOCK_V": block_v, "CHUNK": chunk}}


def gdn_rows_norm_launch(rows: int, width: int, hv: int, dv: int, channels: int, kc: int, target,
                         snap: bool = False) -> dict:
    """``gdn_rows_norm_kernel``: grid [Hv, M / BLOCK_M]; program (j, m) normalises head j of rows
    m * BLOCK_M .. + BLOCK_M and shifts the conv state of channels [p * CH_PER_PROG, (p + 1) *
    CH_PER_PROG), p = m * Hv + j (each channel one owner). ``target.rules["gdn_rows"]`` (sm_90: 16
    rows, 4 warps: 1536 programs at 27B, M = 512). ``snap``: ``gdn_rows_norm_snap_kernel``'s launch, which
    normalises each row as ``gdn_norm_kernel`` does: gdn_norm's warps and FMA contraction, and at most the rule's
    snap_norm_block_m rows a program."""
    r = target.rules["gdn_rows"]
    block_m = min(r.snap_norm_block_m if snap else r.norm_block_m, pow2_at_least(rows))
    grid_m = -(-rows // block_m)
    per = -(-channels // (hv * grid_m))
    step = {"num_warps": target.rules["gdn_norm"].num_warps, **fp_fusion(target.rules["gdn_delta"].fp_fusion)}
    return {"grid": [hv, grid_m, 1], **(step if snap else {"num_warps": r.norm_num_warps}),
            "constexprs": {"M": rows, "W": width, "HV": hv, "DV": dv, "C": channels, "KC": kc, "BLOCK_M": block_m,
                           "BLOCK_DV": pow2_at_least(dv), "CH_PER_PROG": per, "BLOCK_CH": pow2_at_least(per)}}


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _conv_taps(conv_state_ptr, conv_w_ptr, ch, ch_mask, KC: tl.constexpr):
    """What the conv of channels ``ch`` reads besides the new input: (the state window [BLOCK, KCP], its
    column KC - 1 (the input's) zero, and the conv weights [BLOCK, KCP]); see ``_conv_window``."""
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    tl.static_assert(KC <= 16)
    i = tl.arange(0, KCP)[None, :]
    c = ch[:, None]
    m = ch_mask[:, None]
    st = tl.load(conv_state_ptr + c * (KC - 1) + i, mask=m & (i < KC - 1), other=0.0).to(tl.float32)
    w = tl.load(conv_w_ptr + c * KC + i, mask=m & (i < KC), other=0.0).to(tl.float32)
    return st, w


@triton.jit
def _conv_apply(qkv_ptr, st, w, ch, ch_mask, KC: tl.constexpr):
    """The conv of ``_conv_window`` from ``_conv_taps``' state and weights and the input x read now."""
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    i = tl.arange(0, KCP)[None, :]
    x = tl.load(qkv_ptr + ch, mask=ch_mask, other=0.0).to(tl.float32)
    window = tl.where(i == KC - 1, x[:, None], st)
    acc = tl.sum(window * w, axis=1)
    return acc * tl.sigmoid(acc), window


@triton.jit
def _conv_window(qkv_ptr, conv_state_ptr, conv_w_ptr, ch, ch_mask, KC: tl.constexpr):
    """Depthwise causal conv of channels ``ch`` over [state | x], then SiLU.

    Returns (silu(conv) [BLOCK], window [BLOCK, KCP]); window[:, i] is the state column i for
    i < KC - 1 and the raw input x for i == KC - 1 (zero past KC). Nothing is written here: the
    caller stores window[:, 1:KC] as the new state, after a CTA barrier (see ``store_window``)."""
    st, w = _conv_taps(conv_state_ptr, conv_w_ptr, ch, ch_mask, KC)
    return _conv_apply(qkv_ptr, st, w, ch, ch_mask, KC)


@triton.jit
def store_window(conv_state_ptr, window, ch, ch_mask, KC: tl.constexpr):
    """New conv state = the window shifted left by one: column i <- window[:, i + 1]."""
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    i = tl.arange(0, KCP)[None, :]
    tl.store(conv_state_ptr + ch[:, None] * (KC - 1) + (i - 1), window,
             mask=ch_mask[:, None] & (i >= 1) & (i < KC))


@triton.jit
def gdn_delta_kernel(qkv_ptr, b_ptr, a_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, rec_state_ptr,
                     o_raw_ptr, l2_eps, scale,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr,
                     BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False,
                     PRELOAD: tl.constexpr = False):
    """``gdn_delta_ref``: conv1d + SiLU over [conv state | x] (the state is only read), L2 norms of q
    and k, gates, delta rule on the fp32 state [HV, DK, DV] (in place); writes o_raw = S^T q.

    Work split: grid [HV, cdiv(DV, BLOCK_V)]; program (j, c) owns columns c*BLOCK_V .. +BLOCK_V of
    value head j's state S_j [DK, DV] (row-major, so each row of the tile is BLOCK_V contiguous
    fp32: 16-byte vector loads and stores) and the same columns of o_raw. The delta rule is
    independent per column (kv_mem[v] = sum_k S[k, v] k[k]), so no program reads what another
    writes. Each program recomputes q and k of its key head j // (HV / HK) (2 * DK channels x KC
    taps, L2 hits) and the BLOCK_V channels of v it needs. The conv state is shifted later by
    ``gdn_norm_kernel``. Fixed reduction order: results do not depend on scheduling.

    PRELOAD: before its PDL wait (kernels/pdl.py) a program loads what no kernel still running can write: its
    state tile and the conv windows' state (written by this layer's kernels of the previous step, which has
    ended), the conv weights, A_log and dt_bias; after it, the projections (qkv, a, b) the kernel before
    wrote. Else it waits first."""
    if not PRELOAD:
        pdl_wait(PDL)
    R: tl.constexpr = HV // HK
    QKD: tl.constexpr = HK * DK
    j = tl.program_id(0)
    h = j // R

    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = cols < DV
    tile_offs = j * DK * DV + offs_k[:, None] * DV + cols[None, :]
    tile_mask = mk[:, None] & mv[None, :]
    s = tl.load(rec_state_ptr + tile_offs, mask=tile_mask, other=0.0)
    ch_q, ch_k, ch_v = h * DK + offs_k, QKD + h * DK + offs_k, 2 * QKD + j * DV + cols
    st_q, w_q = _conv_taps(conv_state_ptr, conv_w_ptr, ch_q, mk, KC)
    st_k, w_k = _conv_taps(conv_state_ptr, conv_w_ptr, ch_k, mk, KC)
    st_v, w_v = _conv_taps(conv_state_ptr, conv_w_ptr, ch_v, mv, KC)
    dt_bias = tl.load(dt_bias_ptr + j).to(tl.float32)
    neg_a = -tl.exp(tl.load(a_log_ptr + j).to(tl.float32))
    if PRELOAD:
        pdl_wait(PDL)

    q, _ = _conv_apply(qkv_ptr, st_q, w_q, ch_q, mk, KC)
    k, _ = _conv_apply(qkv_ptr, st_k, w_k, ch_k, mk, KC)
    v, _ = _conv_apply(qkv_ptr, st_v, w_v, ch_v, mv, KC)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + l2_eps)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + l2_eps))

    # gates: g = -exp(A_log) * softplus(a + dt_bias) (torch threshold 20), beta = sigmoid(b)
    x = tl.load(a_ptr + j).to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = neg_a * softplus
    beta = tl.sigmoid(tl.load(b_ptr + j).to(tl.float32))

    # delta rule on the column block: S = S * exp(g); S += k (outer) beta * (v - S^T k); o = S^T q
    s = s * tl.exp(g)
    kv_mem = tl.sum(s * k[:, None], axis=0)
    delta = (v - kv_mem) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)

    tl.debug_barrier()  # every old state value this CTA reads has been read
    tl.store(rec_state_ptr + tile_offs, s, mask=tile_mask)
    tl.store(o_raw_ptr + j * DV + cols, o, mask=mv)


@triton.jit
def _gated_norm(o, zz, norm_w, eps, DV: tl.constexpr):
    """norm_w * o * rsqrt(mean(o^2) + eps) * silu(z) of one head's row [BLOCK_DV] (gdn_norm_kernel's, and
    gdn_rows_norm_snap_kernel's a row at a time: the same code, so that their rows agree bit for bit)."""
    y = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps))
    return norm_w * y * (zz * tl.sigmoid(zz))


@triton.jit
def gdn_norm_kernel(o_raw_ptr, z_ptr, qkv_ptr, norm_w_ptr, conv_state_ptr, out_ptr, eps,
                    HV: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, KC: tl.constexpr, BLOCK_DV: tl.constexpr,
                    CH_PER_PROG: tl.constexpr, BLOCK_CH: tl.constexpr, PDL: tl.constexpr = False):
    """``gdn_norm_ref``: out = norm_w * o * rsqrt(mean(o^2) + eps) * silu(z) per value head, and the
    conv-state update (shift left, append the raw input x) of all C channels.

    Work split: grid [HV]; program j normalises value head j (its whole row of o_raw) and shifts
    the conv-state rows of channels [j * CH_PER_PROG, (j + 1) * CH_PER_PROG): every channel has one
    owner, so the in-place update is race-free. It runs after ``gdn_delta_kernel`` (same stream),
    the last reader of the old conv state."""
    pdl_wait(PDL)
    j = tl.program_id(0)

    offs_v = tl.arange(0, BLOCK_DV)
    mv = offs_v < DV
    o = tl.load(o_raw_ptr + j * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    zz = tl.load(z_ptr + j * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + offs_v, mask=mv, other=0.0).to(tl.float32)
    tl.store(out_ptr + j * DV + offs_v, _gated_norm(o, zz, norm_w, eps, DV), mask=mv)
    shift_conv_state(qkv_ptr, conv_state_ptr, j * CH_PER_PROG, C, KC, CH_PER_PROG, BLOCK_CH)


@triton.jit
def shift_conv_state(qkv_ptr, conv_state_ptr, ch0, C: tl.constexpr, KC: tl.constexpr, CH_PER_PROG: tl.constexpr,
                     BLOCK_CH: tl.constexpr):
    """A program's share of the conv-state update after gdn_delta (the last reader of the old state): channels
    [ch0, ch0 + CH_PER_PROG) of C, their window [state | x] stored shifted left by one (conv_shift_ref)."""
    window, ch, mc = conv_window(qkv_ptr, conv_state_ptr, ch0, C, KC, CH_PER_PROG, BLOCK_CH)
    tl.debug_barrier()  # every old state value this CTA reads has been read
    store_window(conv_state_ptr, window, ch, mc, KC)


@triton.jit
def conv_window(qkv_ptr, conv_state_ptr, ch0, C: tl.constexpr, KC: tl.constexpr, CH_PER_PROG: tl.constexpr,
                BLOCK_CH: tl.constexpr):
    """(window, channels, their mask): ``shift_conv_state``'s loads, the window [state | x] of channels
    [ch0, ch0 + CH_PER_PROG) of C; ``store_window`` after a CTA barrier stores it shifted."""
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    tl.static_assert(KC <= 16)
    ch = ch0 + tl.arange(0, BLOCK_CH)
    mc = (tl.arange(0, BLOCK_CH) < CH_PER_PROG) & (ch < C)
    i = tl.arange(0, KCP)[None, :]
    x = tl.load(qkv_ptr + ch, mask=mc, other=0.0).to(tl.float32)
    st = tl.load(conv_state_ptr + ch[:, None] * (KC - 1) + i, mask=mc[:, None] & (i < KC - 1), other=0.0)
    return tl.where(i == KC - 1, x[:, None], st.to(tl.float32)), ch, mc


# ---------------------------------------------------------------------------------------------
# M-row (prefill) kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rows_input(x_ptr, conv_state_ptr, t, xcol, ch, m, W: tl.constexpr, KC: tl.constexpr):
    """The raw conv input of chunk row t for channels ``ch`` (x columns ``xcol``): x[t, xcol] for
    t >= 0, else the conv state's column t + KC - 1 (the inputs before the chunk, oldest first)."""
    xs = tl.load(x_ptr + t * W + xcol, mask=m & (t >= 0), other=0.0)
    st = tl.load(conv_state_ptr + ch * (KC - 1) + (t + (KC - 1)), mask=m & (t < 0) & (t > -KC), other=0.0)
    return tl.where(t >= 0, xs.to(tl.float32), st.to(tl.float32))


@triton.jit
def _rows_tap(conv_w_ptr, ch, m, d: tl.constexpr, KC: tl.constexpr):
    """Conv weight of the input d rows back (d = 0: the row's own input), zero past the kernel."""
    if d < KC:
        return tl.load(conv_w_ptr + ch * KC + (KC - 1 - d), mask=m, other=0.0).to(tl.float32)
    else:
        return tl.zeros(ch.shape, tl.float32)


@triton.jit
def _rows_conv(xn, p1, p2, p3, w0, w1, w2, w3, KC: tl.constexpr):
    """silu of the depthwise conv at a row: input xn, previous inputs p1 (1 row back) .. p3."""
    acc = w0 * xn + w1 * p1
    if KC > 2:
        acc += w2 * p2
    if KC > 3:
        acc += w3 * p3
    return acc * tl.sigmoid(acc)


@triton.jit
def _rows_conv_as_step(xn, p1, p2, p3, w, KC: tl.constexpr):
    """``_rows_conv`` computed as the one-token step's ``_conv_apply`` computes it: the window of taps, oldest
    first, times the weights [BLOCK, KCP] (``_conv_taps``' layout), summed in one reduction."""
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    i = tl.arange(0, KCP)[None, :]
    window = tl.where(i == KC - 1, xn[:, None], tl.where(i == KC - 2, p1[:, None], tl.where(
        i == KC - 3, p2[:, None], tl.where(i == KC - 4, p3[:, None], 0.0))))
    acc = tl.sum(window * w, axis=1)
    return acc * tl.sigmoid(acc)


@triton.jit
def _rows_weights(conv_w_ptr, ch, m, KC: tl.constexpr):
    """The conv weights of channels ``ch`` as ``_conv_taps`` loads them: [BLOCK, KCP], zero past KC."""
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    i = tl.arange(0, KCP)[None, :]
    return tl.load(conv_w_ptr + ch[:, None] * KC + i, mask=m[:, None] & (i < KC), other=0.0).to(tl.float32)


@triton.jit
def _rows_recurrent(x_ptr, conv_state_ptr, conv_w_ptr, o_raw_ptr, s, j, valid, ch_q, ch_k, ch_v, mk, mv, cols,
                    neg_a, dt_bias, qkv, b, a, l2_eps, scale, rows_ptr, k_owner, col0, M: tl.constexpr,
                    W: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr, QKD: tl.constexpr, KC: tl.constexpr,
                    BLOCK_V: tl.constexpr, SNAP: tl.constexpr):
    """The row-by-row form (CHUNK = 0): returns the state tile after the valid rows. SNAP (the verify,
    ``gdn_rows_delta_snap_kernel``): each valid row's update is also stored in row r of rows_ptr
    (``update_row_width`` values a row: its decay exp(g) at [j] by the program of column block 0 (``col0``), its
    normalised keys at [HV + ch_q] by one program of the key head (``k_owner``), its delta at [HV + QKD + j * DV +
    cols]), and each row is computed as the one-token step's ``gdn_delta_kernel`` computes it (the conv as one sum
    over the window of taps, o = S^T q from the updated state), so a verified row is the one-token step's bit for
    bit; without SNAP (prefill) the conv is unrolled and o = S_old^T q + (k . q) delta, which shortens the row's
    dependency chain."""
    tl.static_assert(KC >= 2 and KC <= 4)
    # conv weights by distance back (0: the row itself), constant over the rows
    wq0 = _rows_tap(conv_w_ptr, ch_q, mk, 0, KC)
    wq1 = _rows_tap(conv_w_ptr, ch_q, mk, 1, KC)
    wq2 = _rows_tap(conv_w_ptr, ch_q, mk, 2, KC)
    wq3 = _rows_tap(conv_w_ptr, ch_q, mk, 3, KC)
    wk0 = _rows_tap(conv_w_ptr, ch_k, mk, 0, KC)
    wk1 = _rows_tap(conv_w_ptr, ch_k, mk, 1, KC)
    wk2 = _rows_tap(conv_w_ptr, ch_k, mk, 2, KC)
    wk3 = _rows_tap(conv_w_ptr, ch_k, mk, 3, KC)
    wv0 = _rows_tap(conv_w_ptr, ch_v, mv, 0, KC)
    wv1 = _rows_tap(conv_w_ptr, ch_v, mv, 1, KC)
    wv2 = _rows_tap(conv_w_ptr, ch_v, mv, 2, KC)
    wv3 = _rows_tap(conv_w_ptr, ch_v, mv, 3, KC)
    # the inputs before row 0 (from the conv state; zero past it) and row 0's own (harmless reads
    # when no row is valid: x has M >= 1 rows)
    q1 = _rows_input(x_ptr, conv_state_ptr, -1, qkv + ch_q, ch_q, mk, W, KC)
    q2 = _rows_input(x_ptr, conv_state_ptr, -2, qkv + ch_q, ch_q, mk, W, KC)
    q3 = _rows_input(x_ptr, conv_state_ptr, -3, qkv + ch_q, ch_q, mk, W, KC)
    k1 = _rows_input(x_ptr, conv_state_ptr, -1, qkv + ch_k, ch_k, mk, W, KC)
    k2 = _rows_input(x_ptr, conv_state_ptr, -2, qkv + ch_k, ch_k, mk, W, KC)
    k3 = _rows_input(x_ptr, conv_state_ptr, -3, qkv + ch_k, ch_k, mk, W, KC)
    v1 = _rows_input(x_ptr, conv_state_ptr, -1, qkv + ch_v, ch_v, mv, W, KC)
    v2 = _rows_input(x_ptr, conv_state_ptr, -2, qkv + ch_v, ch_v, mv, W, KC)
    v3 = _rows_input(x_ptr, conv_state_ptr, -3, qkv + ch_v, ch_v, mv, W, KC)
    xq = tl.load(x_ptr + qkv + ch_q, mask=mk, other=0.0).to(tl.float32)
    xk = tl.load(x_ptr + qkv + ch_k, mask=mk, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + qkv + ch_v, mask=mv, other=0.0).to(tl.float32)
    xa = tl.load(x_ptr + a + j).to(tl.float32)
    xb = tl.load(x_ptr + b + j).to(tl.float32)
    if SNAP:  # (the weights as the one-token step's conv takes them)
        wq = _rows_weights(conv_w_ptr, ch_q, mk, KC)
        wk = _rows_weights(conv_w_ptr, ch_k, mk, KC)
        wv = _rows_weights(conv_w_ptr, ch_v, mv, KC)
    for r in range(0, valid):
        if SNAP:
            q = _rows_conv_as_step(xq, q1, q2, q3, wq, KC)
            k = _rows_conv_as_step(xk, k1, k2, k3, wk, KC)
            v = _rows_conv_as_step(xv, v1, v2, v3, wv, KC)
        else:
            q = _rows_conv(xq, q1, q2, q3, wq0, wq1, wq2, wq3, KC)
            k = _rows_conv(xk, k1, k2, k3, wk0, wk1, wk2, wk3, KC)
            v = _rows_conv(xv, v1, v2, v3, wv0, wv1, wv2, wv3, KC)
        q3, q2, q1 = q2, q1, xq
        k3, k2, k1 = k2, k1, xk
        v3, v2, v1 = v2, v1, xv
        gx = xa + dt_bias
        beta = tl.sigmoid(xb)
        # the next row's raw inputs (the last row reloads itself), consumed in the next iteration
        rn = tl.minimum(r + 1, valid - 1) * W
        xq = tl.load(x_ptr + rn + qkv + ch_q, mask=mk, other=0.0).to(tl.float32)
        xk = tl.load(x_ptr + rn + qkv + ch_k, mask=mk, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + rn + qkv + ch_v, mask=mv, other=0.0).to(tl.float32)
        xa = tl.load(x_ptr + rn + a + j).to(tl.float32)
        xb = tl.load(x_ptr + rn + b + j).to(tl.float32)

        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + l2_eps)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + l2_eps))
        # g = -exp(A_log) * softplus(a + dt_bias) (torch threshold 20)
        g = neg_a * tl.where(gx > 20.0, gx, tl.log(1.0 + tl.exp(tl.minimum(gx, 20.0))))
        decay = tl.exp(g)
        s = s * decay
        kv_mem = tl.sum(s * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        if SNAP:
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], axis=0)
            upd = rows_ptr + r * (HV + QKD + HV * DV)
            tl.store(upd + j, decay, mask=col0)
            tl.store(upd + HV + ch_q, k, mask=mk & k_owner)
            tl.store(upd + HV + QKD + j * DV + cols, delta, mask=mv)
        else:
            o_old = tl.sum(s * q[:, None], axis=0)
            s = s + k[:, None] * delta[None, :]
            o = o_old + tl.sum(k * q, axis=0) * delta
        tl.store(o_raw_ptr + r * (HV * DV) + j * DV + cols, o, mask=mv)
    for r in range(valid, M):
        tl.store(o_raw_ptr + r * (HV * DV) + j * DV + cols, tl.zeros([BLOCK_V], tl.float32), mask=mv)
    return s


@triton.jit
def _chunk_conv(x_ptr, conv_state_ptr, conv_w_ptr, rows, rv, xcol, ch, m, W: tl.constexpr, KC: tl.constexpr):
    """silu of the depthwise conv at chunk rows ``rows`` [BT] (valid where ``rv``) for channels ``ch``
    [BLOCK] (x columns ``xcol``): [BT, BLOCK], zero on invalid rows. Tap d reads the input d rows back:
    x[t, xcol] for t >= 0, else the conv state's column t + KC - 1 (one load through either pointer)."""
    acc = tl.zeros([rows.shape[0], ch.shape[0]], tl.float32)
    mm = rv[:, None] & m[None, :]
    for d in tl.static_range(KC):
        t = rows[:, None] - d
        ptr = tl.where(t >= 0, x_ptr + t * W + xcol[None, :], conv_state_ptr + ch[None, :] * (KC - 1) + (t + (KC - 1)))
        w = tl.load(conv_w_ptr + ch * KC + (KC - 1 - d), mask=m, other=0.0).to(tl.float32)
        acc += tl.load(ptr, mask=mm, other=0.0).to(tl.float32) * w[None, :]
    return acc * tl.sigmoid(acc)


@triton.jit
def _tf32(x):
    """x rounded to the nearest TF32 (10-bit mantissa, ties to even), kept in fp32: what the tensor
    cores then multiply exactly, on the GPU and in Triton's interpreter alike (whose dots are fp32),
    so that the interpreter's results carry the GPU's TF32 rounding. x is finite."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rows_chunked(x_ptr, conv_state_ptr, conv_w_ptr, o_raw_ptr, s, j, valid, ch_q, ch_k, ch_v, mk, mv, cols,
                  neg_a, dt_bias, qkv, b, a, l2_eps, scale, M: tl.constexpr, W: tl.constexpr, HV: tl.constexpr,
                  DV: tl.constexpr, KC: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk-parallel form (CHUNK rows a step): returns the state tile after the valid rows.

    With S the state before a chunk, per row t of it G_t = g_0 + .. + g_t, gamma_t = exp(G_t), and
    A[t, s] = beta_t exp(G_t - G_s) (k_t . k_s) for s < t, the rows' deltas (S_t = exp(g_t) S_{t-1}
    + k_t delta_t^T) solve (I + A) Delta = beta V - diag(beta gamma) K S, so with T = (I + A)^-1:
      Delta = T (beta V - diag(beta gamma) K S)            (the WY / UT form)
      O     = diag(gamma) Q S + (tril(Q K^T o exp(G_t - G_s))) Delta
      S'    = exp(G_last) S + (K o exp(G_last - G))^T Delta.
    T is the inverse of a unit lower-triangular matrix, computed by recursive doubling: starting
    from I, at block size b = 1, 2, .., CHUNK / 2 each diagonal block of size 2b [[L1, 0], [A21, L2]]
    gets its lower-left block -T2 A21 T1 (T <- T - T (A restricted to those blocks) T): the blocked
    triangular inverse, not a Neumann series, so no cancellation of large terms. Invalid rows of a
    chunk (t >= valid) get k = v = 0, g = 0, beta = 0: they leave the state and the valid rows alone.
    The exponents of the decays are differences G_t - G_s <= 0 (s <= t): nothing overflows.

    Precision: the products run on tensor cores in TF32 (operands rounded to 10-bit mantissas by
    ``_tf32``, products summed in fp32), the state and everything else in fp32: about 1e-3 relative
    to the fp32 recurrence (the M-row step's projections already round their inputs to bf16). Three
    TF32 passes (fp32-like products) would need about twice the registers: they spill at Dk = 128."""
    LOG2_BT: tl.constexpr = 4 if CHUNK == 16 else (5 if CHUNK == 32 else 6)
    tl.static_assert(CHUNK == 16 or CHUNK == 32 or CHUNK == 64)
    tl.static_assert(BLOCK_V >= 16)
    ti = tl.arange(0, CHUNK)[:, None]
    si = tl.arange(0, CHUNK)[None, :]
    causal = si <= ti
    for c0 in tl.range(0, valid, CHUNK, num_stages=1):  # (no cp.async multi-buffering of the tap loads)
        rows = c0 + tl.arange(0, CHUNK)
        rv = rows < valid
        gx = tl.load(x_ptr + rows * W + a + j, mask=rv, other=0.0).to(tl.float32) + dt_bias
        g = tl.where(rv, neg_a * tl.where(gx > 20.0, gx, tl.log(1.0 + tl.exp(tl.minimum(gx, 20.0)))), 0.0)
        beta = tl.where(rv, tl.sigmoid(tl.load(x_ptr + rows * W + b + j, mask=rv, other=0.0).to(tl.float32)), 0.0)
        gc = tl.cumsum(g, axis=0)
        g_last = tl.sum(g, axis=0)
        gam = tl.exp(gc)
        decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0))  # exp(G_t - G_s), s <= t
        sr = _tf32(s)

        # (in this order to keep few [CHUNK, DK] tiles live at once)
        k = _chunk_conv(x_ptr, conv_state_ptr, conv_w_ptr, rows, rv, qkv + ch_k, ch_k, mk, W, KC)
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + l2_eps))[:, None]
        kt = tl.trans(_tf32(k))
        A = tl.where(si < ti, beta[:, None] * decay * tl.dot(tl.trans(kt), kt, input_precision="tf32"), 0.0)
        T = tl.where(ti == si, 1.0, 0.0)
        for lvl in tl.static_range(LOG2_BT):
            blk = (((ti >> (lvl + 1)) == (si >> (lvl + 1))) & (((ti >> lvl) & 1) == 1)
                   & (((si >> lvl) & 1) == 0))
            tr = _tf32(T)
            t21 = tl.dot(tr, _tf32(tl.where(blk, A, 0.0)), input_precision="tf32")
            T = T - tl.dot(_tf32(t21), tr, input_precision="tf32")
        ks = tl.dot(_tf32(k * (beta * gam)[:, None]), sr, input_precision="tf32")  # the state's part of Delta

        q = _chunk_conv(x_ptr, conv_state_ptr, conv_w_ptr, rows, rv, qkv + ch_q, ch_q, mk, W, KC)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=1) + l2_eps) * scale)[:, None]
        p = tl.where(causal, tl.dot(_tf32(q), kt, input_precision="tf32") * decay, 0.0)
        o = tl.dot(_tf32(q * gam[:, None]), sr, input_precision="tf32")

        v = _chunk_conv(x_ptr, conv_state_ptr, conv_w_ptr, rows, rv, qkv + ch_v, ch_v, mv, W, KC)
        delta = _tf32(tl.dot(_tf32(T), _tf32(v * beta[:, None] - ks), input_precision="tf32"))
        o = tl.dot(_tf32(p), delta, o, input_precision="tf32")
        s = tl.dot(tl.trans(_tf32(k * tl.exp(g_last - gc)[:, None])), delta, s * tl.exp(g_last),
                   input_precision="tf32")
        tl.store(o_raw_ptr + rows[:, None] * (HV * DV) + j * DV + cols[None, :], tl.where(rv[:, None], o, 0.0),
                 mask=(rows < M)[:, None] & mv[None, :])
    for r0 in range(tl.cdiv(valid, CHUNK) * CHUNK, M, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(o_raw_ptr + rows[:, None] * (HV * DV) + j * DV + cols[None, :],
                 tl.zeros([CHUNK, BLOCK_V], tl.float32), mask=(rows < M)[:, None] & mv[None, :])
    return s


@triton.jit
def gdn_rows_delta_kernel(x_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, rec_state_ptr, pos_ptr,
                          n_prompt_ptr, o_raw_ptr, qkv, b, a, l2_eps, scale,
                          M: tl.constexpr, W: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                          DV: tl.constexpr, KC: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr,
                          CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """``gdn_rows_delta_ref``: for each valid row r (r < clamp(n_prompt - pos, 0, M)) in order, the
    one-token ``gdn_delta_kernel`` on x[r]: conv1d + SiLU over the window [conv state | x[0..r]]
    (the state only read), L2 norms of q and k, gates from x[r, a + j], x[r, b + j], delta rule on
    the fp32 state [HV, DK, DV] (advanced in place), o_raw[r] = S^T q; o_raw[r] = 0 on invalid rows.

    Work split: grid [HV, cdiv(DV, BLOCK_V)]; program (j, c) owns columns c*BLOCK_V .. +BLOCK_V of
    value head j's state S_j (and of o_raw). It loads that [DK, BLOCK_V] tile once, keeps it in
    registers through its loop over the valid rows, and stores it once. It recomputes the conv of
    its key head's q and k (2 * DK channels) and of its BLOCK_V v channels (L2 hits).

    CHUNK = 0, the row-by-row form (``_rows_recurrent``; conv kernels of 2 to 4 taps): one row a
    step, exactly the reference's recurrence; each channel's last KC - 1 raw inputs stay in
    registers (one new load per channel a row, issued a row ahead so that its latency overlaps the
    current row's delta rule); o = S_r^T q is computed as (decayed S_{r-1})^T q + (k . q) delta
    (equal in exact arithmetic), so the two reductions over DK are independent of each other.
    CHUNK = 16, 32 or 64, the chunk-parallel form (``_rows_chunked``; BLOCK_V >= 16): CHUNK rows a
    step as matrix products on tensor cores; the same recurrence in exact arithmetic, but summed in
    another order and with TF32 products: about 1e-3 of the largest value off the fp32 reference
    (tests bound it at 4e-3).

    Race-free: the delta rule is independent per state column, so no program reads what another
    writes; x and the conv state are only read (``gdn_rows_norm_kernel`` shifts the conv state next).
    Deterministic: every reduction and product has a fixed order, nothing depends on scheduling."""
    _gdn_rows_delta(x_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, rec_state_ptr, pos_ptr, n_prompt_ptr,
                    o_raw_ptr, o_raw_ptr, qkv, b, a, l2_eps, scale, M, W, HK, HV, DK, DV, KC, BLOCK_DK, BLOCK_V,
                    CHUNK, False, PDL)


@triton.jit
def gdn_rows_delta_snap_kernel(x_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, rec_state_ptr, pos_ptr,
                               n_prompt_ptr, rec_rows_ptr, o_raw_ptr, qkv, b, a, l2_eps, scale,
                               M: tl.constexpr, W: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
                               DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr, BLOCK_DK: tl.constexpr,
                               BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """``gdn_rows_delta_snap_ref``: ``gdn_rows_delta_kernel`` row by row (CHUNK = 0) that leaves the recurrent
    state as it was and stores each valid row's update into rec_rows[r] ([M, update_row_width]): the verify's
    rows, which ``gdn_commit_kernel`` applies to the state once the accepted count is known. Same work split as
    gdn_rows_delta_kernel; every value of rec_rows has one writer (a row's decay: the value head's column block
    0; its keys: column block 0 of the key head's first value head), and no program writes what another reads."""
    _gdn_rows_delta(x_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, rec_state_ptr, pos_ptr, n_prompt_ptr,
                    o_raw_ptr, rec_rows_ptr, qkv, b, a, l2_eps, scale, M, W, HK, HV, DK, DV, KC, BLOCK_DK, BLOCK_V,
                    CHUNK, True, PDL)


@triton.jit
def _gdn_rows_delta(x_ptr, conv_state_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, rec_state_ptr, pos_ptr, n_prompt_ptr,
                    o_raw_ptr, rows_ptr, qkv, b, a, l2_eps, scale, M: tl.constexpr, W: tl.constexpr,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KC: tl.constexpr,
                    BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, SNAP: tl.constexpr,
                    PDL: tl.constexpr):
    """The body of the two kernels above (SNAP: the verify's, the rows' updates to rows_ptr, the state not
    stored)."""
    pdl_wait(PDL)
    tl.static_assert(M * W < 2**31)
    R: tl.constexpr = HV // HK
    QKD: tl.constexpr = HK * DK
    j = tl.program_id(0)
    h = j // R
    valid = tl.minimum(tl.maximum(tl.load(n_prompt_ptr) - tl.load(pos_ptr), 0), M)

    offs_k = tl.arange(0, BLOCK_DK)
    mk = offs_k < DK
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = cols < DV
    ch_q = h * DK + offs_k
    ch_k = QKD + ch_q
    ch_v = 2 * QKD + j * DV + cols

    tile_offs = j * DK * DV + offs_k[:, None] * DV + cols[None, :]
    tile_mask = mk[:, None] & mv[None, :]
    s = tl.load(rec_state_ptr + tile_offs, mask=tile_mask, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(a_log_ptr + j).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + j).to(tl.float32)
    if CHUNK == 0:
        col0 = tl.program_id(1) == 0
        s = _rows_recurrent(x_ptr, conv_state_ptr, conv_w_ptr, o_raw_ptr, s, j, valid, ch_q, ch_k, ch_v, mk, mv,
                            cols, neg_a, dt_bias, qkv, b, a, l2_eps, scale, rows_ptr, col0 & (j % R == 0), col0, M,
                            W, HV, DV, QKD, KC, BLOCK_V, SNAP)
    else:
        tl.static_assert(not SNAP, "the verify's rows are taken row by row (CHUNK = 0)")
        s = _rows_chunked(x_ptr, conv_state_ptr, conv_w_ptr, o_raw_ptr, s, j, valid, ch_q, ch_k, ch_v, mk, mv,
                          cols, neg_a, dt_bias, qkv, b, a, l2_eps, scale, M, W, HV, DV, KC, BLOCK_V, CHUNK)
    if not SNAP:  # (the verify leaves the state to gdn_commit_kernel)
        tl.debug_barrier()  # every old state value this CTA reads has been read
        tl.store(rec_state_ptr + tile_offs, s, mask=tile_mask)


@triton.jit
def gdn_rows_norm_kernel(o_raw_ptr, x_ptr, norm_w_ptr, conv_state_ptr, pos_ptr, n_prompt_ptr, out_ptr, z, qkv, eps,
                         M: tl.constexpr, W: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                         KC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, CH_PER_PROG: tl.constexpr,
                         BLOCK_CH: tl.constexpr, PDL: tl.constexpr = False):
    """``gdn_rows_norm_ref``: out[r, head j] = norm_w * o * rsqrt(mean(o^2) + eps) * silu(z) with
    o = o_raw[r, head j], z = x[r, z + head j] for all M rows (invalid rows' o_raw is 0, so their
    out is 0), and the conv state advanced by the valid rows: new column i = the raw input of chunk
    row t = valid - (KC - 1) + i, i.e. x[t, qkv + c] for t >= 0, else old column t + KC - 1.

    Work split: grid [HV, cdiv(M, BLOCK_M)]; program (j, m) normalises head j of rows m * BLOCK_M ..
    +BLOCK_M, and owns conv-state channels [p * CH_PER_PROG, (p + 1) * CH_PER_PROG), p = m * HV + j:
    every channel has exactly one owner, which alone reads its old state and writes the new one, so
    the in-place update is race-free (and the result is a copy of inputs: deterministic). It runs
    after ``gdn_rows_delta_kernel`` (same stream), the last reader of the old conv state."""
    _gdn_rows_norm(o_raw_ptr, x_ptr, norm_w_ptr, conv_state_ptr, pos_ptr, n_prompt_ptr, out_ptr, conv_state_ptr, z,
                   qkv, eps, M, W, HV, DV, C, KC, BLOCK_M, BLOCK_DV, CH_PER_PROG, BLOCK_CH, False, PDL)


@triton.jit
def gdn_rows_norm_snap_kernel(o_raw_ptr, x_ptr, norm_w_ptr, conv_state_ptr, pos_ptr, n_prompt_ptr, conv_snap_ptr,
                              out_ptr, z, qkv, eps, M: tl.constexpr, W: tl.constexpr, HV: tl.constexpr,
                              DV: tl.constexpr, C: tl.constexpr, KC: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_DV: tl.constexpr, CH_PER_PROG: tl.constexpr, BLOCK_CH: tl.constexpr,
                              PDL: tl.constexpr = False):
    """``gdn_rows_norm_snap_ref``: ``gdn_rows_norm_kernel`` that also writes, for its own channels, the
    conv window after every valid row r < M - 1 into conv_snap[r] ([M - 1, C, KC - 1]; the verify's
    rollback points, made from the same inputs before the in-place update), and normalises each row as
    ``gdn_norm_kernel`` normalises the one-token step's (``_gated_norm``, with its launch's warps)."""
    _gdn_rows_norm(o_raw_ptr, x_ptr, norm_w_ptr, conv_state_ptr, pos_ptr, n_prompt_ptr, out_ptr, conv_snap_ptr, z,
                   qkv, eps, M, W, HV, DV, C, KC, BLOCK_M, BLOCK_DV, CH_PER_PROG, BLOCK_CH, True, PDL)


@triton.jit
def _gdn_rows_norm(o_raw_ptr, x_ptr, norm_w_ptr, conv_state_ptr, pos_ptr, n_prompt_ptr, out_ptr, snap_ptr, z, qkv,
                   eps, M: tl.constexpr, W: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                   KC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, CH_PER_PROG: tl.constexpr,
                   BLOCK_CH: tl.constexpr, SNAP: tl.constexpr, PDL: tl.constexpr):
    """The body of the two kernels above (SNAP: the conv-window snapshots)."""
    pdl_wait(PDL)
    tl.static_assert(M * W < 2**31)
    KCP: tl.constexpr = 4 if KC <= 4 else (8 if KC <= 8 else 16)
    tl.static_assert(KC <= 16)
    j = tl.program_id(0)
    mb = tl.program_id(1)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mr = rows < M
    offs_v = tl.arange(0, BLOCK_DV)
    mv = offs_v < DV
    m2 = mr[:, None] & mv[None, :]
    col = j * DV + offs_v[None, :]
    norm_w = tl.load(norm_w_ptr + offs_v, mask=mv, other=0.0).to(tl.float32)
    if SNAP:  # a verify's rows: each as gdn_norm_kernel computes the one-token step's (one row, one reduction)
        for i in tl.static_range(BLOCK_M):
            row = mb * BLOCK_M + i
            m1 = mv & (row < M)
            o1 = tl.load(o_raw_ptr + row * (HV * DV) + j * DV + offs_v, mask=m1, other=0.0).to(tl.float32)
            z1 = tl.load(x_ptr + row * W + z + j * DV + offs_v, mask=m1, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * (HV * DV) + j * DV + offs_v, _gated_norm(o1, z1, norm_w, eps, DV), mask=m1)
    else:
        o = tl.load(o_raw_ptr + rows[:, None] * (HV * DV) + col, mask=m2, other=0.0).to(tl.float32)
        zz = tl.load(x_ptr + rows[:, None] * W + z + col, mask=m2, other=0.0).to(tl.float32)
        y = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=1) / DV + eps))[:, None]
        tl.store(out_ptr + rows[:, None] * (HV * DV) + col, norm_w[None, :] * y * (zz * tl.sigmoid(zz)), mask=m2)

    # this program's conv-state channels: new column i <- input of chunk row valid - (KC - 1) + i
    valid = tl.minimum(tl.maximum(tl.load(n_prompt_ptr) - tl.load(pos_ptr), 0), M)
    p = mb * HV + j
    ch = p * CH_PER_PROG + tl.arange(0, BLOCK_CH)
    mc = (tl.arange(0, BLOCK_CH) < CH_PER_PROG) & (ch < C)
    i = tl.arange(0, KCP)[None, :]
    t = valid - (KC - 1) + i
    m = mc[:, None] & (i < KC - 1)
    xs = tl.load(x_ptr + t * W + qkv + ch[:, None], mask=m & (t >= 0), other=0.0)
    st = tl.load(conv_state_ptr + ch[:, None] * (KC - 1) + (t + (KC - 1)), mask=m & (t < 0), other=0.0)
    new = tl.where(t >= 0, xs.to(tl.float32), st.to(tl.float32))
    if SNAP:  # the window after each valid row r < M - 1 (row r + 1 - (KC - 1) + i is column i's input)
        for r in tl.static_range(M - 1):
            tr = r + 1 - (KC - 1) + i
            xr = tl.load(x_ptr + tr * W + qkv + ch[:, None], mask=m & (tr >= 0), other=0.0)
            sr = tl.load(conv_state_ptr + ch[:, None] * (KC - 1) + (tr + (KC - 1)), mask=m & (tr < 0), other=0.0)
            tl.store(snap_ptr + r * (C * (KC - 1)) + ch[:, None] * (KC - 1) + i,
                     tl.where(tr >= 0, xr.to(tl.float32), sr.to(tl.float32)), mask=m & (r < valid))
    tl.debug_barrier()  # every old state value this CTA reads has been read
    tl.store(conv_state_ptr + ch[:, None] * (KC - 1) + i, new, mask=m)


def gdn_commit_launch(hk: int, hv: int, dk: int, dv: int, channels: int, kc: int, rows: int, target) -> dict:
    """``gdn_commit_kernel``: grid [cdiv(max(Hv*Dk*Dv, C*(KC-1)), BLOCK), 2]: axis 1 picks the recurrent state (0,
    BLOCK elements of it a program) or the conv windows (1); BLOCK, warps and the row loop's pipeline STAGES from
    ``target.rules["gdn_delta"]`` (commit_*)
    (a streaming copy's shape: the update has no reduction, so its layout does not change its bits), FMA
    contraction as ``gdn_delta``'s (``target.rules["gdn_delta"].fp_fusion``: the update's arithmetic is the
    verify's)."""
    r = target.rules["gdn_delta"]
    n_rec, n_conv = hv * dk * dv, channels * (kc - 1)
    return {"grid": [-(-max(n_rec, n_conv) // r.commit_block), 2, 1], "num_warps": r.commit_warps,
            **fp_fusion(r.fp_fusion),
            "constexprs": {"M": rows, "HK": hk, "HV": hv, "DK": dk, "DV": dv, "N_CONV": n_conv,
                           "BLOCK": r.commit_block, "STAGES": r.commit_stages}}


@triton.jit
def gdn_commit_kernel(rec_state_ptr, rec_rows_ptr, conv_state_ptr, conv_snap_ptr, pos_ptr, npos_ptr,
                      M: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      N_CONV: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """``gdn_commit_ref``: with kept = npos - pos of the M verified rows accepted, program (p, 0) advances elements
    p * BLOCK .. + BLOCK of the flattened recurrent state [HV, DK, DV] by the updates of rows 0 .. kept - 1 in
    rec_rows (S = S * decay, then S + k * delta: the verify's two statements on the same values, so the same
    bits), and program (p, 1) copies its elements of the conv windows back from conv_snap[kept - 1] when kept < M.
    Each program reads and writes its own elements only: nothing races."""
    pdl_wait(PDL)
    R: tl.constexpr = HV // HK
    QKD: tl.constexpr = HK * DK
    N_REC: tl.constexpr = HV * DK * DV
    kept = tl.load(npos_ptr) - tl.load(pos_ptr)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        n = tl.minimum(tl.maximum(kept, 0), M)
        m = (offs < N_REC) & (n > 0)
        j = offs // (DK * DV)
        kk = (offs // DV) % DK
        col = offs % DV
        s = tl.load(rec_state_ptr + offs, mask=m, other=0.0)
        for r in tl.range(0, n, num_stages=STAGES if STAGES > 0 else None):
            upd = rec_rows_ptr + r * (HV + QKD + HV * DV)
            decay = tl.load(upd + j, mask=m, other=0.0)
            k = tl.load(upd + HV + (j // R) * DK + kk, mask=m, other=0.0)
            delta = tl.load(upd + HV + QKD + j * DV + col, mask=m, other=0.0)
            s = s * decay
            s = s + k * delta
        tl.store(rec_state_ptr + offs, s, mask=m)
    else:
        m = (offs < N_CONV) & (kept >= 1) & (kept < M)
        snap = tl.minimum(tl.maximum(kept - 1, 0), M - 2).to(tl.int64)
        tl.store(conv_state_ptr + offs, tl.load(conv_snap_ptr + snap * N_CONV + offs, mask=m), mask=m)
