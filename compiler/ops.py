"""The op registry: one record per op kind, every rule about that kind in one place (the JAX way).

An ``OpDef`` says, for its op kind,
  * ``operands``  one letter per operand: v value, w weight, s state, d dyn slot, t tensor (v|w|s);
  * ``attrs``     attribute names, in the order the kernel takes them as scalars;
  * ``options``   attributes an op may carry that are no kernel scalars (absent by default): its launch rule
                  compiles them in as constexprs (``yarn``: the RoPE ops' YaRN parameters);
  * ``infer``     the shape/type rule: operands + attrs -> result types (raises IRError);
  * ``inout``     operand indices the op updates in place (states); ``writes_dyn``: results are dyn slots;
  * ``view``      whether an instance moves no data (reshape, leading slices alias their input);
  * ``reference`` the CPU reference (kernels/<family>.py), called as ``reference(*operands, **attrs)``
                  and returning the results (tensors; for ``writes_dyn`` ops the slot values);
  * ``kernel``    the GPU kernel: its Triton function and launch rule (``Kernel``), or
                  ``NotApplicable(why)`` where the GPU runs it inside a fused kernel or not at all;
  * ``onnx``      its ONNX lowering, ``onnx(exporter, op, *operands)`` -> tensor name(s)
                  (compiler/onnx_export.py's primitives), or ``NotApplicable(why)``.
A part that does not apply is declared so, never omitted (tests/test_ops.py walks the registry).

``verify`` checks a whole program against these records; ``emit`` appends an op with its inferred
result types. Adding an op kind: one ``OpDef`` here plus its kernel file (README, "Adding an op").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kestrel.compiler.ir import Dyn, IRError, Op, Program, State, TensorType, Value, Weight, is_q4, q4_group
from kestrel.kernels import (attention, bf16_mma, elementwise, embedding, gated_delta, gemm, matvec, moe, mtp,
                             q4_mma, q4_stream, rmsnorm, sample, speculative)
from kestrel.kernels.gated_delta import gdn_key_heads
from kestrel.kernels.targets import Target


@dataclass(frozen=True)
class NotApplicable:
    """A part of an op's record that does not apply, and why."""

    why: str


@dataclass(frozen=True)
class Kernel:
    """The GPU kernel of an op kind: the Triton function (kestrel.kernels.<family>) and its launch
    rule, ``launch(op, target)`` -> {"kernel": id, "grid", "num_warps", "constexprs"}. The id names
    the family and the operand dtypes (``matvec_q4g128``); the ABI is compiler/codegen.py's."""

    jit: object
    launch: Callable[[Op, Target], dict]
    rows: object = None  # the Triton function when the op runs at M rows (a [M, ...] first operand), if another
    # (kernel id prefix, Triton function): launches whose kernel id (the launch rule's) starts with the
    # prefix run that function (the matmuls at a few rows: the matvec, not the GEMM)
    variants: tuple[tuple[str, object], ...] = ()

    def jit_for(self, op: Op):
        for prefix, jit in self.variants:
            if op.launch["kernel"].startswith(prefix):
                return jit
        at_rows = self.rows is not None and len(op.ins[0].type.shape) == 2
        return self.rows if at_rows else self.jit


@dataclass(frozen=True)
class OpDef:
    name: str
    operands: str
    attrs: tuple[str, ...]
    infer: Callable[[list, dict], list[TensorType]]
    reference: Callable
    kernel: Kernel | NotApplicable
    onnx: Callable | NotApplicable
    inout: tuple[int, ...] = ()
    options: tuple[str, ...] = ()
    writes_dyn: bool = False
    view: Callable[[Op], bool] | None = None
    doc: str = ""


# --- shape rules -------------------------------------------------------------------------------

def _t(x) -> TensorType:
    return x.type


def _f32(shape) -> TensorType:
    return TensorType("f32", tuple(shape))


def _need(cond: bool, msg: str):
    if not cond:
        raise IRError(msg)


def _same_shape(*xs):
    shapes = [tuple(_t(x).shape) for x in xs]
    _need(all(s == shapes[0] for s in shapes), f"shapes differ: {shapes}")
    return shapes[0]


def _infer_embedding(ins, a):
    table, tok = ins
    _need(len(_t(table).shape) == 2, "embedding table must be [vocab, hidden]")
    _need(tok.dtype == "i32", "embedding token slot must be i32")
    return [_f32((_t(table).shape[1],))]


def _infer_embedding_rmsnorm(ins, a):
    table, tok, w = ins
    (x,) = _infer_embedding([table, tok], a)
    _need(_t(w).shape == x.shape, f"embedding_rmsnorm weight {_t(w).shape} vs the row {x.shape}")
    return [x, x]


def _infer_rmsnorm(ins, a):
    x, w = ins
    _need(_t(w).shape == (_t(x).shape[-1],), f"rmsnorm weight {_t(w).shape} vs last axis of {_t(x).shape}")
    return [_f32(_t(x).shape)]


def _infer_matmul(ins, a):
    """x [K] -> [N]; M rows x [M, K] -> [M, N]."""
    x, w = ins
    xs, ws = _t(x).shape, _t(w).shape
    _need(len(xs) in (1, 2) and len(ws) == 2 and ws[1] == xs[-1], f"matmul {list(xs)} x W{list(ws)}: W must be "
          f"[out, {xs[-1]}]")
    return [_f32(xs[:-1] + (ws[0],))]


def _infer_same(ins, a):
    return [_f32(_same_shape(*ins))]


def _infer_reshape(ins, a):
    (x,) = ins
    shape = tuple(a["shape"])
    _need(math.prod(shape) == _t(x).numel, f"reshape {_t(x).shape} -> {shape} changes the element count")
    return [TensorType(_t(x).dtype, shape)]


def _infer_slice(ins, a):
    (x,) = ins
    shape = list(_t(x).shape)
    ax, lo, hi = a["axis"], a["start"], a["stop"]
    _need(0 <= ax < len(shape) and 0 <= lo < hi <= shape[ax], f"slice axis={ax} [{lo}:{hi}] out of {tuple(shape)}")
    shape[ax] = hi - lo
    return [TensorType(_t(x).dtype, tuple(shape))]


def _infer_conv1d_step(ins, a):
    x, st, w = ins
    (c,) = _t(x).shape
    _need(_t(w).shape[0] == c and len(_t(w).shape) == 2, f"conv weight {_t(w).shape} must be [{c}, K]")
    k = _t(w).shape[1]
    _need(_t(st).shape == (c, k - 1), f"conv state {_t(st).shape} must be [{c}, {k - 1}]")
    _need(a["act"] in ("silu", "none"), f"conv1d_step act must be silu or none, not {a['act']!r}")
    return [_f32((c,))]


def _infer_gdn_gates(ins, a):
    _need(len({_t(x).shape for x in ins}) == 1 and len(_t(ins[0]).shape) == 1, "gdn_gates operands must all be [Hv]")
    return [_f32(_t(ins[0]).shape), _f32(_t(ins[0]).shape)]


def _infer_gated_delta(ins, a):
    q, k, v, g, beta, st = ins
    hk, dk = _t(q).shape
    hv, dv = _t(v).shape
    _need(_t(k).shape == (hk, dk), f"k {_t(k).shape} must match q {(hk, dk)}")
    _need(hv % hk == 0, f"value heads {hv} must be a multiple of key heads {hk}")
    _need(_t(g).shape == (hv,) and _t(beta).shape == (hv,), "g and beta must be [Hv]")
    _need(_t(st).shape == (hv, dk, dv) and _t(st).dtype == "f32", f"recurrent state must be f32[{hv},{dk},{dv}]")
    return [_f32((hv, dv))]


def _infer_gated_rmsnorm(ins, a):
    x, z, w = ins
    _same_shape(x, z)
    _need(_t(w).shape == (_t(x).shape[-1],), "gated_rmsnorm weight must match the last axis")
    return [_f32(_t(x).shape)]


def _infer_rope(ins, a):
    x, pos = ins
    _need(len(_t(x).shape) == 2, "rope input must be [heads, head_dim]")
    rd = a["rotary_dim"]
    _need(rd % 2 == 0 and 0 < rd <= _t(x).shape[1], f"rotary_dim {rd} must be even and <= head_dim")
    _need(pos.dtype == "i32", "rope position must be an i32 dyn slot")
    return [_f32(_t(x).shape)]


def _infer_kv_append(ins, a):
    kc, vc, k, v, pos = ins
    s, hkv, d = _t(kc).shape
    _need(_t(vc).shape == (s, hkv, d), "k and v caches must have the same shape")
    _need(_t(k).shape == (hkv, d) and _t(v).shape == (hkv, d), f"k, v must be [{hkv},{d}]")
    return []


def _infer_attention(ins, a):
    q, kc, vc, pos = ins
    h, d = _t(q).shape
    s, hkv, dk = _t(kc).shape
    _need(dk == d and h % hkv == 0, f"q {(h, d)} incompatible with cache {(s, hkv, dk)}")
    return [_f32((h, d))]


def _infer_sample(ins, a):
    logits, temp, top_p, top_k, min_p, seed, pos, partials, ticket = ins
    _need(len(_t(logits).shape) == 1, "sample takes a [vocab] logits vector")
    _need(top_k.dtype == "i32" and min_p.dtype == "f32", "sample's top_k slot must be i32, its min_p slot f32")
    _need(_t(partials).dtype == "f32" and _t(ticket).dtype == "i32" and _t(ticket).shape == (1,),
          "sample's scratch: f32 partials and one i32 ticket")
    return []


def _sample_ref(logits, temperature, top_p, top_k, min_p, seed, pos, partials, ticket):
    """sample_ref; the partials and the ticket are the GPU kernel's scratch."""
    return sample.sample_ref(logits, temperature, top_p, top_k, min_p, seed, pos)


def _infer_step_end(ins, a):
    pos, sampled, n_prompt, tokens = ins
    _need(_t(tokens).dtype == "i32" and len(_t(tokens).shape) == 1, "step_end's token sequence must be i32[max_seq]")
    return []


def _infer_add_rmsnorm(ins, a):
    x, y, w = ins
    shape = _same_shape(x, y)
    _need(_t(w).shape == (shape[-1],), "add_rmsnorm weight must match the last axis")
    return [_f32(shape), _f32(shape)]


def _infer_matmul_swiglu(ins, a):
    x, wg, wu = ins
    _need(_t(wg).shape == _t(wu).shape, f"gate {_t(wg).shape} and up {_t(wu).shape} weights differ")
    return _infer_matmul([x, wg], a)


def _infer_matmul_add(ins, a):
    """x [K], W [N, K], r [N] -> s [N], ss [ceil(N / partial_rows)]; at M rows (passes/fold_row_norms.py)
    x [M, K], r [M, N] -> s [M, N], ss [M, ceil(N / partial_rows)]."""
    x, w, r = ins
    _need(len(_t(x).shape) in (1, 2), "matmul_add takes one row or [M, K]")
    out = _infer_matmul([x, w], a)[0].shape
    _need(_t(r).shape == out, f"matmul_add residual {_t(r).shape} vs the product's {out}")
    rows = a["partial_rows"]
    _need(isinstance(rows, int) and rows > 0, "matmul_add partial_rows must be a positive int")
    return [_f32(out), _f32(out[:-1] + ((out[-1] + rows - 1) // rows,))]


def _infer_rmsnorm_matmul(ins, a):
    """s [K], ss [P], norm weight [K], then the matmul's (or matmul_swiglu's) weights; at M rows s [M, K],
    ss [M, P]."""
    s, ss, nw, *ws = ins
    _need(len(_t(s).shape) in (1, 2), "rmsnorm_matmul takes one row or [M, K]")
    _need(len(_t(ss).shape) == len(_t(s).shape) and _t(ss).shape[:-1] == _t(s).shape[:-1]
          and _t(ss).dtype == "f32", "rmsnorm_matmul partials must be f32[P] (f32[M, P] at M rows)")
    _need(_t(nw).shape == _t(s).shape[-1:], f"rmsnorm weight {_t(nw).shape} vs the input {_t(s).shape}")
    return _infer_matmul_swiglu([s, *ws], a) if len(ws) == 2 else _infer_matmul([s, *ws], a)


def _infer_gdn_step(ins, a):
    qkv, z, b, av, conv_state, conv_w, a_log, dt_bias, norm_w, rec = ins
    hv, _, dv = _t(rec).shape
    _need(_t(z).shape == (hv * dv,), f"z must be [{hv * dv}]")
    _need(_t(norm_w).shape == (dv,), f"the norm weight must be [{dv}]")
    return _infer_gdn_delta([qkv, b, av, conv_state, conv_w, a_log, dt_bias, rec], a)


def gdn_layer_heads(qkv, rec) -> tuple[int, int, int, int]:
    """(Hk, Hv, Dk, Dv) of a Gated DeltaNet op from its qkv vector and recurrent state."""
    hv, dk, dv = _t(rec).shape
    return gdn_key_heads(_t(qkv).shape[0], hv, dk, dv), hv, dk, dv


def _infer_gdn_delta(ins, a):
    qkv, b, av, conv_state, conv_w, a_log, dt_bias, rec = ins
    hk, hv, dk, dv = gdn_layer_heads(qkv, rec)
    (c,) = _t(qkv).shape
    _need(_t(rec).dtype == "f32", "recurrent state must be f32")
    _need(_t(b).shape == (hv,) and _t(av).shape == (hv,), f"a and b must be [{hv}]")
    _need(hk > 0, f"qkv [{c}] does not split into q, k, v heads (value heads {hv} a multiple of the key heads)")
    kk = _t(conv_w).shape[1] if len(_t(conv_w).shape) == 2 else 0
    _need(_t(conv_w).shape == (c, kk) and _t(conv_state).shape == (c, kk - 1), "conv weight/state do not match qkv")
    _need(_t(a_log).shape == (hv,) and _t(dt_bias).shape == (hv,), "A_log, dt_bias must be [Hv]")
    return [_f32((hv * dv,))]


def _infer_rows_dyn(*slots):
    for d in slots:
        _need(d.dtype == "i32", f"dyn slot {d.name} must be i32")


def _infer_embedding_rows(ins, a):
    table, tokens, pos, n_prompt = ins
    _need(len(_t(table).shape) == 2 and _t(tokens).dtype == "i32" and len(_t(tokens).shape) == 1,
          "embedding_rows takes a [vocab, hidden] table and the i32 token sequence")
    _need(a["rows"] > 0, "rows must be positive")
    _infer_rows_dyn(pos, n_prompt)
    return [_f32((a["rows"], _t(table).shape[1]))]


def _infer_gdn_rows(ins, a):
    qkv, b, av, conv_state, conv_w, a_log, dt_bias, rec, pos, n_prompt = ins
    _need(len(_t(qkv).shape) == 2 and _t(b).shape[:1] == _t(qkv).shape[:1] == _t(av).shape[:1],
          "gdn_rows: qkv, b and a must be [M, ...] with the same M")
    rows = _t(qkv).shape[0]
    row = [Value(TensorType("f32", _t(x).shape[1:])) for x in (qkv, b, av)]
    (n,) = _infer_gdn_delta([row[0], row[1], row[2], conv_state, conv_w, a_log, dt_bias, rec], a)[0].shape
    _infer_rows_dyn(pos, n_prompt)
    return [_f32((rows, n))]


def _infer_attn_rows(ins, a):
    qg, k, v, qn, kn, kc, vc, pos, n_prompt = ins
    _need(len(_t(qg).shape) == 2 and _t(k).shape[:1] == _t(qg).shape[:1] == _t(v).shape[:1],
          "attn_rows: q|gate, k and v must be [M, ...] with the same M")
    rows, (n2,) = _t(qg).shape[0], _t(qg).shape[1:]
    s, hkv, d = _t(kc).shape
    _need(n2 % (2 * d) == 0 and (n2 // (2 * d)) % hkv == 0, f"q|gate [{n2}] does not split into heads of {d}")
    _need(_t(k).shape[1:] == (hkv * d,) and _t(v).shape[1:] == (hkv * d,), f"k, v rows must be [{hkv * d}]")
    _need(_t(qn).shape == (d,) and _t(kn).shape == (d,) and _t(vc).shape == _t(kc).shape,
          "q/k norm weights must be [head_dim] and the caches alike")
    _need(a["rotary_dim"] % 2 == 0 and 0 < a["rotary_dim"] <= d, "rotary_dim must be even and <= head_dim")
    _infer_rows_dyn(pos, n_prompt)
    return [_f32((rows, n2 // 2))]


def _cols(x, start: int, n: int, what: str):
    _need(len(_t(x).shape) == 2 and 0 <= start and start + n <= _t(x).shape[1],
          f"{what}: columns {start}..{start + n} are not inside the [M, W] projection rows {_t(x).shape}")


def _infer_gdn_rows_delta(ins, a):
    x, conv_state, conv_w, a_log, dt_bias, rec, pos, n_prompt = ins
    hv = _t(rec).shape[0]
    c = _t(conv_w).shape[0]
    for what, start, n in (("qkv", a["qkv"], c), ("b", a["b"], hv), ("a", a["a"], hv)):
        _cols(x, start, n, f"gdn_rows_delta {what}")
    m = _t(x).shape[0]
    row = [Value(TensorType("f32", (n,))) for n in (c, hv, hv)]
    (n,) = _infer_gdn_delta([row[0], row[1], row[2], conv_state, conv_w, a_log, dt_bias, rec], a)[0].shape
    _infer_rows_dyn(pos, n_prompt)
    return [_f32((m, n))]


def _infer_gdn_rows_norm(ins, a):
    o, x, norm_w, conv_state, pos, n_prompt = ins
    m, n = _t(o).shape
    c = _t(conv_state).shape[0]
    _need(len(_t(norm_w).shape) == 1 and n % _t(norm_w).shape[0] == 0,
          f"norm weight {_t(norm_w).shape} must be [Dv] with Dv dividing {n}")
    _need(_t(x).shape[0] == m, "gdn_rows_norm: o_raw and the projection rows differ in M")
    _cols(x, a["z"], n, "gdn_rows_norm z")
    _cols(x, a["qkv"], c, "gdn_rows_norm qkv")
    _infer_rows_dyn(pos, n_prompt)
    return [_f32((m, n))]


def _infer_attn_rows_kv(ins, a):
    x, kn, kc, vc, pos, n_prompt = ins
    _, hkv, d = _t(kc).shape
    _cols(x, a["k"], hkv * d, "attn_rows_kv k")
    _cols(x, a["v"], hkv * d, "attn_rows_kv v")
    _need(_t(kn).shape == (d,) and _t(vc).shape == _t(kc).shape, "k norm weight must be [head_dim], caches alike")
    _need(a["rotary_dim"] % 2 == 0 and 0 < a["rotary_dim"] <= d, "rotary_dim must be even and <= head_dim")
    _infer_rows_dyn(pos, n_prompt)
    return []


def _infer_attn_rows_q(ins, a):
    x, qn, kc, vc, pos, n_prompt, part, tickets = ins
    _, hkv, d = _t(kc).shape
    h = a["heads"]
    _need(h > 0 and h % hkv == 0, f"attn_rows_q: {h} query heads do not group over {hkv} kv heads")
    _cols(x, a["q"], 2 * h * d, "attn_rows_q q|gate")
    _need(_t(qn).shape == (d,) and _t(vc).shape == _t(kc).shape, "q norm weight must be [head_dim], caches alike")
    _need(a["rotary_dim"] % 2 == 0 and 0 < a["rotary_dim"] <= d, "rotary_dim must be even and <= head_dim")
    _infer_rows_dyn(pos, n_prompt)
    _need(_t(part).dtype == "f32" and len(_t(part).shape) == 2 and _t(part).shape[1] == d + 2
          and _t(tickets).dtype == "i32" and len(_t(tickets).shape) == 1,
          f"attn_rows_q's scratch: f32 partials [n, {d + 2}] and i32 tickets [groups]")
    return [_f32((_t(x).shape[0], h * d))]


def _infer_last_row(ins, a):
    x, pos, n_prompt = ins
    _need(len(_t(x).shape) == 2, "last_row takes [M, N] rows")
    _infer_rows_dyn(pos, n_prompt)
    return [_f32(_t(x).shape[1:])]


def _infer_chunk_last(ins, a):
    _infer_rows_dyn(*ins)
    _need(a["rows"] > 0, "rows must be positive")
    return []


def _infer_prefill_end(ins, a):
    _need(a["rows"] > 0, "rows must be positive")
    return _infer_step_end(ins, a)


def _infer_gdn_norm(ins, a):
    o, z, qkv, norm_w, conv_state = ins
    (n,) = _t(o).shape
    (c,) = _t(qkv).shape
    _need(len(_t(norm_w).shape) == 1 and n % _t(norm_w).shape[0] == 0,
          f"norm weight {_t(norm_w).shape} must be [Dv] with Dv dividing {n}")
    _need(_t(z).shape == (n,), f"z must be [{n}]")
    _need(c > n and len(_t(conv_state).shape) == 2 and _t(conv_state).shape[0] == c,
          f"conv state {_t(conv_state).shape} does not match qkv [{c}]")
    return [_f32((n,))]


def attn_heads(op: Op) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) of an attn_step op."""
    _, hkv, d = _t(op.ins[5]).shape
    return _t(op.ins[0]).shape[0] // (2 * d), hkv, d


def _infer_attn_step(ins, a):
    qg, k, v, qn, kn, kc, vc, pos, part, ticket = ins
    s, hkv, d = _t(kc).shape
    (n2,) = _t(qg).shape
    _need(n2 % (2 * d) == 0 and (n2 // (2 * d)) % hkv == 0, f"q|gate [{n2}] does not split into heads of {d}")
    _need(_t(k).shape == (hkv * d,) and _t(v).shape == (hkv * d,), f"k, v must be [{hkv * d}]")
    _need(_t(qn).shape == (d,) and _t(kn).shape == (d,), "q/k norm weights must be [head_dim]")
    _need(_t(vc).shape == _t(kc).shape, "k and v caches differ")
    _need(a["rotary_dim"] % 2 == 0 and 0 < a["rotary_dim"] <= d, "rotary_dim must be even and <= head_dim")
    nh = n2 // (2 * d)
    splits = _t(part).shape[1] if len(_t(part).shape) == 3 else 0
    _need(_t(part).dtype == "f32" and _t(part).shape == (nh, splits, d + 2) and splits & (splits - 1) == 0
          and splits > 0, f"attention partials must be f32[{nh}, SPLITS (a power of two), {d + 2}]")
    _need(_t(ticket).dtype == "i32" and _t(ticket).shape == (nh,), f"attention tickets must be i32[{nh}]")
    return [_f32((n2 // 2,))]


# --- the speculative iteration (--speculative mtp; kernels/speculative.py, kernels/mtp.py) -----------

def _infer_concat(ins, a):
    x, y = ins
    xs, ys = _t(x).shape, _t(y).shape
    _need(len(xs) == len(ys) and xs[:-1] == ys[:-1], f"concat {list(xs)} and {list(ys)}: leading shapes differ")
    return [_f32(xs[:-1] + (xs[-1] + ys[-1],))]


def _infer_embedding_next_rows(ins, a):
    table, tokens, pos, bound, sampled = ins
    _infer_rows_dyn(sampled)
    return _infer_embedding_rows([table, tokens, pos, bound], a)


def _infer_spec_begin(ins, a):
    _infer_rows_dyn(*ins)
    _need(a["rows"] > 1, "spec_begin: the verify has at least 2 rows (one draft)")
    return []


def _infer_argmax_rows(ins, a):
    (x,) = ins
    _need(len(_t(x).shape) == 2, "argmax_rows takes [R, V] logits")
    return [TensorType("i32", _t(x).shape[:1])]


def _infer_accept(ins, a):
    targets, pos, tokens = ins
    _need(_t(targets).dtype == "i32" and len(_t(targets).shape) == 1 and _t(targets).shape[0] >= 2,
          "accept: the target's choices must be i32[K + 1], K >= 1")
    _need(_t(tokens).dtype == "i32" and len(_t(tokens).shape) == 1, "accept: the token sequence must be i32[max_seq]")
    _infer_rows_dyn(pos)
    return []


def _spec_scratch(partials, tickets, what: str):
    _need(_t(partials).dtype == "f32" and len(_t(partials).shape) == 2 and _t(tickets).dtype == "i32"
          and len(_t(tickets).shape) == 1, f"{what}'s scratch: f32 partials [n, w] and i32 tickets [rows]")


def _infer_spec_filter(ins, a):
    logits, temp, top_p, top_k, min_p, partials, tickets = ins
    _need(len(_t(logits).shape) in (1, 2), "spec_filter takes [vocab] or [rows, vocab] logits")
    rows = _t(logits).shape[0] if len(_t(logits).shape) == 2 else 1
    _infer_rows_dyn(top_k)
    _need(temp.dtype == "f32" and top_p.dtype == "f32" and min_p.dtype == "f32", "spec_filter: f32 sampling slots")
    _spec_scratch(partials, tickets, "spec_filter")
    _need(_t(tickets).shape[0] >= rows, "spec_filter: a ticket per row")
    return []


def _infer_draft_sample(ins, a):
    logits, draft, temp, top_p, top_k, min_p, seed, dpos, q, partials, tickets = ins
    _spec_scratch(partials, tickets, "draft_sample")
    _need(len(_t(logits).shape) == 1, "draft_sample takes a [vocab] logits vector")
    _infer_rows_dyn(draft, top_k, seed, dpos)
    _need(temp.dtype == "f32" and top_p.dtype == "f32" and min_p.dtype == "f32", "draft_sample: f32 sampling slots")
    _need(_t(q).dtype == "f32" and len(_t(q).shape) == 2 and _t(q).shape[1] == _t(logits).shape[0]
          and 0 <= a["row"] < _t(q).shape[0], "draft_sample: q rows must be f32[K, vocab] and row in [0, K)")
    return []


def _infer_spec_sample_rows(ins, a):
    logits, greedy, q, tokens, replay, pos, temp, top_p, top_k, min_p, seed, replay_on, partials, tickets = ins
    _spec_scratch(partials, tickets, "spec_sample_rows")
    r, v = _t(logits).shape if len(_t(logits).shape) == 2 else (0, 0)
    _need(_t(tickets).shape[0] >= r, "spec_sample_rows: a ticket per row")
    _need(r >= 2 and _t(greedy).dtype == "i32" and _t(greedy).shape == (r,),
          "spec_sample_rows: [K + 1, V] logits and their i32[K + 1] greedy choices")
    _need(_t(q).dtype == "f32" and _t(q).shape == (r - 1, v), f"spec_sample_rows: q rows must be f32[{r - 1}, {v}]")
    _need(_t(tokens).dtype == "i32" and _t(replay).dtype == "i32" and _t(tokens).shape == _t(replay).shape
          and len(_t(tokens).shape) == 1, "spec_sample_rows: the token and replay sequences must be i32[max_seq]")
    _infer_rows_dyn(pos, top_k, seed, replay_on)
    return [TensorType("i32", (r,))]


def _infer_replay_drafts(ins, a):
    pos, replay_on, accept, seed, replay, tokens = ins
    _infer_rows_dyn(pos, replay_on, seed)
    _need(accept.dtype == "f32", "replay_drafts: the acceptance slot must be f32")
    _need(_t(tokens).dtype == "i32" and _t(replay).dtype == "i32" and _t(tokens).shape == _t(replay).shape
          and len(_t(tokens).shape) == 1, "replay_drafts: the token and replay sequences must be i32[max_seq]")
    _need(a["rows"] > 1 and a["vocab"] >= 2, "replay_drafts: at least one draft and two tokens")
    return []


def _infer_draft_end(ins, a):
    dpos, draft, n_prompt, tokens = ins
    _infer_rows_dyn(dpos, draft, n_prompt)
    _need(_t(tokens).dtype == "i32" and len(_t(tokens).shape) == 1, "draft_end: the token sequence must be i32")
    return []


def _infer_spec_end(ins, a):
    _infer_rows_dyn(*ins)
    return []


def _snap_shapes(rows: int, rec, conv_state, rec_rows=None, conv_snap=None, hk: int | None = None):
    """The verify's per-row states: the rows' updates [M, update_row_width] (``hk`` key heads; None: any that
    divides the value heads) and the conv windows' snapshots [M - 1, C, K - 1]."""
    if rec_rows is not None:
        hv, dk, dv = _t(rec).shape
        n = _t(rec_rows).shape
        keys = gated_delta.update_row_keys(n[-1], hv, dk, dv) if len(n) == 2 else 0
        _need(_t(rec_rows).dtype == "f32" and len(n) == 2 and n[0] == rows and keys > 0 and hv % keys == 0
              and n[1] == gated_delta.update_row_width(keys, hv, dk, dv) and (hk is None or keys == hk),
              f"the verify's row updates must be f32[{rows}, Hv + Hk * Dk + Hv * Dv] (Hv, Dk, Dv = {hv}, {dk}, {dv}"
              + (f", Hk = {hk})" if hk else ")"))
    if conv_snap is not None:
        _need(_t(conv_snap).dtype == "f32" and _t(conv_snap).shape == (rows - 1,) + _t(conv_state).shape,
              f"conv-window snapshots must be f32[{rows - 1}, {', '.join(map(str, _t(conv_state).shape))}]")


def _infer_gdn_rows_snap(ins, a):
    *base, rec_rows, conv_snap = ins
    out = _infer_gdn_rows(base, a)
    hv, dk, dv = _t(base[7]).shape
    hk = gated_delta.gdn_key_heads(_t(base[0]).shape[1], hv, dk, dv)
    _snap_shapes(_t(base[0]).shape[0], base[7], base[3], rec_rows, conv_snap, hk)
    return out


def _infer_gdn_rows_delta_snap(ins, a):
    *base, rec_rows = ins
    out = _infer_gdn_rows_delta(base, a)
    hv, dk, dv = _t(base[5]).shape
    hk = gated_delta.gdn_key_heads(_t(base[1]).shape[0], hv, dk, dv)
    _snap_shapes(_t(base[0]).shape[0], base[5], base[1], rec_rows=rec_rows, hk=hk)
    return out


def _infer_gdn_rows_norm_snap(ins, a):
    *base, conv_snap = ins
    out = _infer_gdn_rows_norm(base, a)
    _snap_shapes(_t(base[0]).shape[0], None, base[3], conv_snap=conv_snap)
    return out


def _infer_gdn_commit(ins, a):
    rec, rec_rows, conv_state, conv_snap, pos, npos = ins
    _need(len(_t(rec_rows).shape) == 2, "gdn_commit: the row updates must be [M, Hv + Hk * Dk + Hv * Dv]")
    _snap_shapes(_t(rec_rows).shape[0], rec, conv_state, rec_rows, conv_snap)
    _infer_rows_dyn(pos, npos)
    return []


def _lead(x) -> tuple[int, ...]:
    """() for one row [H], (M,) for rows [M, H]."""
    return tuple(_t(x).shape[:-1])


def _infer_moe_router(ins, a):
    x, w = ins
    xs, ws = _t(x).shape, _t(w).shape
    _need(len(xs) in (1, 2) and len(ws) == 2 and ws[1] == xs[-1], f"moe_router {list(xs)} x W{list(ws)}: the "
          f"router must be [experts, {xs[-1]}]")
    _need(isinstance(a["top_k"], int) and 1 <= a["top_k"] <= ws[0], f"moe_router top_k {a['top_k']} must be in "
          f"1..{ws[0]} (the experts)")
    _need(a["norm_topk"] in (0, 1), "moe_router norm_topk must be 0 or 1")
    lead = _lead(x)
    return [TensorType("i32", lead + (a["top_k"],)), _f32(lead + (a["top_k"],))]


def _infer_moe_topk(ins, a):
    (logits,) = ins
    ls = _t(logits).shape
    _need(len(ls) in (1, 2) and _t(logits).dtype == "f32", f"moe_topk logits {_t(logits)} must be f32 [E] or [M, E]")
    _need(isinstance(a["top_k"], int) and 1 <= a["top_k"] <= ls[-1], f"moe_topk top_k {a['top_k']} must be in "
          f"1..{ls[-1]} (the experts)")
    _need(a["norm_topk"] in (0, 1), "moe_topk norm_topk must be 0 or 1")
    return [TensorType("i32", ls[:-1] + (a["top_k"],)), _f32(ls[:-1] + (a["top_k"],))]


def _moe_check(x, ids, wg, wu, sg, su, sgate, wd=None, sd=None, experts=None) -> tuple[int, int, int, int, int]:
    """(E, H, I, Is, k) of an MoE block's operands (stacked gate/up [E * I, H], down [E * H, I])."""
    lead, h = _lead(x), _t(x).shape[-1]
    _need(_t(ids).dtype == "i32" and _lead(ids) == lead, f"moe: expert ids {_t(ids)} must be i32 [{lead}, k]")
    k = _t(ids).shape[-1]
    if wd is not None:
        _need(len(_t(wd).shape) == 2 and _t(wd).shape[0] % h == 0, f"moe: stacked down {_t(wd).shape} must be "
              f"[E * {h}, I]")
        experts = _t(wd).shape[0] // h
    ei = _t(wg).shape[0]
    _need(experts > 0 and ei % experts == 0, f"moe: stacked gate rows {ei} are not a multiple of {experts} experts")
    inter = ei // experts
    _need(_t(wg).shape == (ei, h) and _t(wu).shape == (ei, h), f"moe: stacked gate/up must be [{ei}, {h}]")
    _need(k <= experts, f"moe: {k} experts chosen of {experts}")
    s = _t(sg).shape[0]
    _need(_t(sg).shape == (s, h) and _t(su).shape == (s, h), f"moe: shared gate/up must be [{s}, {h}]")
    _need(_t(sgate).shape == (1, h), f"moe: shared expert gate must be [1, {h}]")
    if wd is not None:
        _need(_t(wd).shape == (experts * h, inter), f"moe: stacked down must be [{experts * h}, {inter}]")
        _need(_t(sd).shape == (h, s), f"moe: shared down must be [{h}, {s}]")
    return experts, h, inter, s, k


def _infer_moe_experts(ins, a):
    x, ids, wts, wg, wu, wd, sg, su, sd, sgate = ins
    _moe_check(x, ids, wg, wu, sg, su, sgate, wd, sd)
    _need(_t(wts).dtype == "f32" and _t(wts).shape == _t(ids).shape, "moe: routing weights must be f32 like the ids")
    return [_f32(_t(x).shape)]


def _infer_moe_gate_up(ins, a):
    x, ids, wg, wu, sg, su, sgate = ins
    e, h, inter, s, k = _moe_check(x, ids, wg, wu, sg, su, sgate, experts=a["experts"])
    return [_f32(_lead(x) + (k * inter + s + 1,))]


def _infer_moe_down(ins, a):
    act, ids, wts, wd, sd = ins
    h, s = _t(sd).shape
    _need(len(_t(wd).shape) == 2 and _t(wd).shape[0] % h == 0, f"moe_down: stacked down {_t(wd).shape} must be "
          f"[E * {h}, I]")
    inter, k = _t(wd).shape[1], _t(ids).shape[-1]
    _need(_t(ids).dtype == "i32" and _t(wts).shape == _t(ids).shape and _t(wts).dtype == "f32",
          "moe_down: i32 ids and f32 weights of one shape")
    _need(_t(act).shape == _lead(ids) + (k * inter + s + 1,), f"moe_down: act {_t(act).shape} must be "
          f"[{k} * {inter} + {s} + 1]")
    return [_f32(_lead(ids) + (h,))]


def _infer_moe_down_add(ins, a):
    """moe_down's operands, then the residual r [H] -> s [H], ss [ceil(H / partial_rows)] (matmul_add's)."""
    *down, r = ins
    (y,) = _infer_moe_down(down, a)
    _need(len(y.shape) == 1, "moe_down_add takes one row")
    _need(_t(r).shape == y.shape, f"moe_down_add residual {_t(r).shape} vs the block's {y.shape}")
    rows = a["partial_rows"]
    _need(isinstance(rows, int) and rows > 0, "moe_down_add partial_rows must be a positive int")
    return [y, _f32(((y.shape[0] + rows - 1) // rows,))]


def _infer_rmsnorm_moe_gate_up(ins, a):
    """s [H], ss [P], norm weight [H], then moe_gate_up's ids and weights."""
    s, ss, nw, *rest = ins
    _need(len(_t(s).shape) == 1, "rmsnorm_moe_gate_up takes one row")
    _need(len(_t(ss).shape) == 1 and _t(ss).dtype == "f32", "rmsnorm_moe_gate_up partials must be f32[P]")
    _need(_t(nw).shape == _t(s).shape, f"rmsnorm weight {_t(nw).shape} vs the input {_t(s).shape}")
    return _infer_moe_gate_up([s, *rest], a)


def _infer_moe_group(ins, a):
    """ids i32 [M, k] -> src i32 [P], pos i32 [P], chunks i32 [C, 4] (P = M k; kernels/moe.py)."""
    (ids,) = ins
    _need(_t(ids).dtype == "i32" and len(_t(ids).shape) == 2, f"moe_group: ids {_t(ids)} must be i32 [M, k]")
    e, r = a["experts"], a["chunk"]
    _need(isinstance(e, int) and e > 0 and isinstance(r, int) and 1 <= r <= q4_mma.MAX_ROWS,
          f"moe_group: experts > 0, chunk 1..{q4_mma.MAX_ROWS} (the few-rows matvec's 4, the q4 tensor-core kernel's 16)")
    p = math.prod(_t(ids).shape)
    _need(e * p < 2 ** 31, f"moe_group: {e} experts x {p} pairs overflow its 32-bit sort keys")
    return [TensorType("i32", (p,)), TensorType("i32", (p,)), TensorType("i32", (moe.grouped_chunks(p, e, r), 4))]


def _need_chunk_rows(chunks, pairs: int, a: dict, what: str) -> None:
    """The chunk table holds the rows moe_group makes for chunks of ``chunk`` pairs (the attribute, which tells
    the grouped kernels how many rows a chunk may hold)."""
    e, r = a["experts"], a["chunk"]
    _need(isinstance(r, int) and 1 <= r <= q4_mma.MAX_ROWS, f"{what}: chunk {r} must be 1..{q4_mma.MAX_ROWS}")
    _need(_t(chunks).shape[0] == moe.grouped_chunks(pairs, e, r),
          f"{what}: a chunk table of {_t(chunks).shape[0]} rows, not the {moe.grouped_chunks(pairs, e, r)} of "
          f"{pairs} pairs in chunks of {r}")


def _need_chunk_table(chunks, what: str) -> None:
    _need(len(_t(chunks).shape) == 2 and _t(chunks).shape[1] == 4 and _t(chunks).dtype == "i32",
          f"{what}: the chunk table must be i32 [C, 4], not {_t(chunks).dtype} {list(_t(chunks).shape)}")


def _infer_moe_gate_up_grouped(ins, a):
    """x [M, H], src [P] (P = M k), chunks [C, 4], stacked gate / up [E * I, H] -> act_s [P, I]."""
    x, src, chunks, wg, wu = ins
    e = a["experts"]
    _need(len(_t(x).shape) == 2 and len(_t(src).shape) == 1 and _t(src).dtype == "i32"
          and _t(src).shape[0] % _t(x).shape[0] == 0,
          f"moe_gate_up_grouped: x [M, H] and src i32 [M k], not {list(_t(x).shape)} / {list(_t(src).shape)}")
    _need_chunk_table(chunks, "moe_gate_up_grouped")
    h, (p,) = _t(x).shape[1], _t(src).shape
    _need_chunk_rows(chunks, p, a, "moe_gate_up_grouped")
    _need(_t(wg).shape == _t(wu).shape and _t(wg).shape[1] == h and _t(wg).shape[0] % e == 0,
          f"moe_gate_up_grouped: stacked gate / up {_t(wg).shape} must be [{e} * I, {h}]")
    return [_f32((p, _t(wg).shape[0] // e))]


def _infer_moe_down_grouped(ins, a):
    """act_s [P, I], chunks [C, 4], stacked down [E * H, I] -> y_s [P, H]."""
    act, chunks, wd = ins
    e = a["experts"]
    _need_chunk_table(chunks, "moe_down_grouped")
    _need_chunk_rows(chunks, _t(act).shape[0], a, "moe_down_grouped")
    _need(_t(wd).shape[1] == _t(act).shape[1] and _t(wd).shape[0] % e == 0,
          f"moe_down_grouped: stacked down {_t(wd).shape} must be [{e} * H, {_t(act).shape[1]}]")
    return [_f32((_t(act).shape[0], _t(wd).shape[0] // e))]


def _infer_moe_combine(ins, a):
    """y_s [P, H], pos [P], weights [M, k], x [M, H], shared gate [1, H], shared expert [M, H] -> y [M, H]."""
    ys, pos, wts, x, sgate, sh = ins
    (m, k), (_, h) = _t(wts).shape, _t(x).shape
    _need(_t(ys).shape == (m * k, h) and _t(pos).shape == (m * k,) and _t(sh).shape == (m, h)
          and _t(sgate).shape == (1, h), "moe_combine: y_s [M k, H], pos [M k], shared [M, H], gate [1, H]")
    return [_f32((m, h))]


# --- launch rules: op -> kernel id and launch configuration (constants per target: kernels/) ---------

def _matrix(w: Weight) -> tuple[int, int, int]:
    """(N, K, q4 group or 0) of a matrix weight."""
    n, k = w.type.shape
    return n, k, q4_group(w.type.dtype) if is_q4(w.type.dtype) else 0


def _matvec(op: Op, t: Target) -> dict:
    """One row: the matvec (kernels/matvec.py); M rows: the tensor-core GEMM (kernels/gemm.py), or at a
    few rows (M <= the gemm rule's few_rows_matvec: a speculative verify's k + 1) the matvec's few-rows
    form, which reads each weight tile once for up to four rows; q4 (bf16) at 2..the q4_mma (bf16_mma) rule's
    max_rows rows the tensor-core product (kernels/q4_mma.py, kernels/bf16_mma.py) where it fits."""
    w = op.ins[1]
    n, k, group = _matrix(w)
    swiglu = op.kind == "matmul_swiglu"
    if len(op.ins[0].type.shape) == 2:
        m = op.ins[0].type.shape[0]
        if (mma := _mma_launch(op, t, pair=swiglu)) is not None:
            kind = ("q4mma" if group else "bf16mma") + ("_rows_swiglu_" if swiglu else "_rows_")
            return {"kernel": kind + w.type.dtype, **mma}
        if m <= t.rules["gemm"].few_rows_matvec:
            return {"kernel": ("matvec_rows_swiglu_" if swiglu else "matvec_rows_") + w.type.dtype,
                    **matvec.matvec_rows_launch(m, n, k, group, t, pair=swiglu)}
        return {"kernel": ("gemm_swiglu_" if swiglu else "gemm_") + w.type.dtype,
                **gemm.gemm_launch(op.ins[0].type.shape[0], n, k, group, t, swiglu=swiglu)}
    if (mma := _one_row_mma(op, t, pair=swiglu)) is not None:
        return {"kernel": "q4mma" + ("_rows_swiglu_" if swiglu else "_rows_") + w.type.dtype, **mma}
    if not swiglu and (stream := q4_stream.stream_launch(n, k, group, t)) is not None:
        return {"kernel": "q4stream_" + w.type.dtype, **stream}
    prefix = "matvec_swiglu_" if swiglu else "matvec_"
    return {"kernel": prefix + w.type.dtype, **matvec.matvec_launch(n, k, group, t, pair=swiglu)}


def mma_launch(x_shape, w_dtype: str, w_shape, t: Target, pair: bool = False, norm: bool = False,
               add: bool = False) -> dict | None:
    """The tensor-core few-rows product's launch of a matmul at M rows (x [M, K]) with weights of ``w_dtype``
    [N, K]: q4 (kernels/q4_mma.py) or bf16 (kernels/bf16_mma.py) where the target's rule runs it, else None.
    ``norm``: the input normed in the kernel; ``add``: the residual add (matmul_add). passes/fold_row_norms.py
    folds exactly where this is not None."""
    (m, k), (n, _) = x_shape, w_shape
    if is_q4(w_dtype):
        g = q4_group(w_dtype)
        return q4_mma.add_launch(m, n, k, g, t) if add else q4_mma.rule_launch(m, n, k, g, t, pair=pair, norm=norm)
    if w_dtype == "bf16":
        return bf16_mma.add_launch(m, n, k, t) if add else bf16_mma.rule_launch(m, n, k, t, pair=pair, norm=norm)
    return None


def _mma_launch(op: Op, t: Target, pair: bool = False, norm: bool = False, add: bool = False) -> dict | None:
    w = op.ins[3 if norm else 1]
    return mma_launch(op.ins[0].type.shape, w.type.dtype, w.type.shape, t, pair, norm, add)


def _one_row_mma(op: Op, t: Target, pair: bool = False, norm: bool = False, add: bool = False) -> dict | None:
    """A q4 matmul at one row on the tensor-core kernel, split as at ``q4_mma.one_row_as`` rows with M = 1 (the
    one-token step's products then the speculative verify's, row for row), or None (the rule's default 0, not q4,
    or the kernel does not take the shape)."""
    w = op.ins[3 if norm else 1]
    r = t.rules.get("q4_mma")
    if r is None or not r.one_row_as or not is_q4(w.type.dtype):
        return None
    c = mma_launch((r.one_row_as, op.ins[0].type.shape[-1]), w.type.dtype, w.type.shape, t, pair, norm, add)
    if c is not None:
        c["constexprs"]["M"] = 1
    return c


def _mma_kind(w: Weight) -> str:
    return "q4mma" if is_q4(w.type.dtype) else "bf16mma"


def _folded_at_rows(launch: dict | None, op: Op) -> dict:
    """The tensor-core kernel's launch of an op fold_row_norms made at M rows (it folds only where there is
    one)."""
    if launch is None:
        raise IRError(f"{op.kind} at M rows {op.ins[0].type.shape}: the tensor-core few-rows kernel does not take "
                      "it on this target (passes/fold_row_norms.py folds only where it does)")
    return launch


def _matvec_add(op: Op, t: Target) -> dict:
    """matvec_kernel's launch rule; partial_rows (select_kernels sets it) is its BLOCK_N. At M rows the
    tensor-core kernel with the add (kernels/q4_mma.py add_launch: 16 rows a partial)."""
    w = op.ins[1]
    if len(op.ins[0].type.shape) == 2:
        return {"kernel": _mma_kind(w) + "_add_" + w.type.dtype, **_folded_at_rows(_mma_launch(op, t, add=True), op)}
    if (mma := _one_row_mma(op, t, add=True)) is not None:
        return {"kernel": "q4mma_add_" + w.type.dtype, **mma}
    if (stream := q4_stream.stream_launch(*_matrix(w), t, add=True)) is not None:
        return {"kernel": "q4stream_add_" + w.type.dtype, **stream}
    return {"kernel": "matvec_add_" + w.type.dtype, **matvec.matvec_launch(*_matrix(w), t)}


def _rmsnorm_matvec(op: Op, t: Target) -> dict:
    """matvec_kernel's (matvec_swiglu_kernel's) launch rule, with the producer's partials (operand 1). At M
    rows the tensor-core kernel with the norm (its rstd from the partials)."""
    w = op.ins[3]
    swiglu = op.kind == "rmsnorm_matmul_swiglu"
    if len(op.ins[0].type.shape) == 2:
        mma = _mma_launch(op, t, pair=swiglu, norm=True)
        if mma is not None and mma["constexprs"]["NP"] != op.ins[1].type.shape[1]:
            mma = None  # the partials are not one per 16 inputs (not made by the kernel with the add)
        kind = _mma_kind(w) + ("_norm_swiglu_" if swiglu else "_norm_")
        return {"kernel": kind + w.type.dtype, **_folded_at_rows(mma, op)}
    mma = _one_row_mma(op, t, pair=swiglu, norm=True)
    if mma is not None and mma["constexprs"]["NP"] == op.ins[1].type.shape[0]:  # partials one per 16 inputs
        return {"kernel": "q4mma" + ("_norm_swiglu_" if swiglu else "_norm_") + w.type.dtype, **mma}
    if op.ins[2].type.dtype == "f32" and (stream := q4_stream.stream_launch(
            *_matrix(w), t, pair=swiglu, norm=True, partials=op.ins[1].type.shape[0])) is not None:
        return {"kernel": ("q4stream_norm_swiglu_" if swiglu else "q4stream_norm_") + w.type.dtype, **stream}
    return {"kernel": ("rmsnorm_matvec_swiglu_" if swiglu else "rmsnorm_matvec_") + w.type.dtype,
            **matvec.rmsnorm_matvec_launch(*_matrix(w), op.ins[1].type.shape[0], t, pair=swiglu)}


def _embedding_rmsnorm(op: Op, t: Target) -> dict:
    return {"kernel": f"embedding_rmsnorm_{op.ins[0].type.dtype}",
            **embedding.embedding_rmsnorm_launch(op.outs[0].type.shape[0], t)}


def _rmsnorm(op: Op, t: Target) -> dict:
    return {"kernel": op.kind, **rmsnorm.rmsnorm_launch(op.ins[0].type.shape, t)}


def _gdn_delta(op: Op, t: Target) -> dict:
    hk, hv, dk, dv = gdn_layer_heads(op.ins[0], op.ins[7])
    return {"kernel": "gdn_delta", **gated_delta.gdn_delta_launch(hk, hv, dk, dv, op.ins[4].type.shape[1], t)}


def _gdn_norm(op: Op, t: Target) -> dict:
    dv = op.ins[3].type.shape[0]
    c, kc1 = op.ins[4].type.shape
    return {"kernel": "gdn_norm", **gated_delta.gdn_norm_launch(op.ins[0].type.shape[0] // dv, dv, c, kc1 + 1, t)}


def _attn_step(op: Op, t: Target) -> dict:
    nh, nkv, d = attn_heads(op)
    kc = op.ins[5]
    splits = op.ins[8].type.shape[1]
    return _with_yarn(op, {"kernel": f"attn_step_{kc.type.dtype}",
                           **attention.attn_step_launch(nh, nkv, d, kc.type.shape[0], splits, kc.type.dtype, t)})


def _with_yarn(op: Op, launch: dict) -> dict:
    """A RoPE kernel's launch with the op's YaRN parameters as its ``YARN`` constexpr, where it has them."""
    if "yarn" not in op.attrs:
        return launch
    return launch | {"constexprs": launch["constexprs"] | {"YARN": list(op.attrs["yarn"])}}


def _embedding_rows(op: Op, t: Target) -> dict:
    rows, h = op.outs[0].type.shape
    return {"kernel": f"embedding_rows_{op.ins[0].type.dtype}",
            **embedding.embedding_rows_launch(rows, h, op.ins[1].type.shape[0], t)}


def _last_row(op: Op, t: Target) -> dict:
    rows, n = op.ins[0].type.shape
    launch = sample.rows_tail_launch(n, t)
    return {"kernel": "last_row", **launch, "constexprs": {**launch["constexprs"], "ROWS": rows, "N": n}}


def _chunk_last(op: Op, t: Target) -> dict:
    launch = sample.rows_tail_launch(1, t)
    return {"kernel": "chunk_last", **launch, "constexprs": {**launch["constexprs"], "ROWS": op.attrs["rows"]}}


def _prefill_end(op: Op, t: Target) -> dict:
    launch = sample.rows_tail_launch(1, t)
    return {"kernel": "prefill_end", **launch,
            "constexprs": {**launch["constexprs"], "ROWS": op.attrs["rows"], "S": op.ins[3].type.shape[0]}}


def _gdn_rows_delta(op: Op, t: Target, **chunk) -> dict:
    rows, width = op.ins[0].type.shape
    conv_w, rec = op.ins[2], op.ins[5]
    hv, dk, dv = rec.type.shape
    hk = gdn_key_heads(conv_w.type.shape[0], hv, dk, dv)
    return {"kernel": "gdn_rows_delta",
            **gated_delta.gdn_rows_delta_launch(rows, width, hk, hv, dk, dv, conv_w.type.shape[1], t, **chunk)}


def _gdn_rows_norm(op: Op, t: Target, snap: bool = False) -> dict:
    rows, width = op.ins[1].type.shape
    dv = op.ins[2].type.shape[0]
    c, kc1 = op.ins[3].type.shape
    return {"kernel": "gdn_rows_norm",
            **gated_delta.gdn_rows_norm_launch(rows, width, op.ins[0].type.shape[1] // dv, dv, c, kc1 + 1, t, snap)}


def _attn_rows_kv(op: Op, t: Target) -> dict:
    rows, width = op.ins[0].type.shape
    s, hkv, d = op.ins[2].type.shape
    return _with_yarn(op, {"kernel": f"attn_rows_kv_{op.ins[2].type.dtype}",
                           **attention.attn_rows_kv_launch(rows, width, hkv, d, s, op.ins[2].type.dtype, t)})


def _attn_rows_q(op: Op, t: Target) -> dict:
    rows, width = op.ins[0].type.shape
    s, hkv, d = op.ins[2].type.shape
    prefix, launch = attention.attn_rows_launch(rows, width, op.attrs["heads"], hkv, d, s, op.ins[2].type.dtype, t)
    part, tickets = attention.attn_rows_scratch(launch, d)
    if (op.ins[6].type.shape, op.ins[7].type.shape) != (part, tickets):
        raise IRError(f"attn_rows_q: its scratch is {op.ins[6].type.shape} / {op.ins[7].type.shape}, the launch "
                      f"needs {part} / {tickets} (select_kernels sizes it)")
    return _with_yarn(op, {"kernel": f"{prefix}{op.ins[2].type.dtype}", **launch})


def _sample(op: Op, t: Target) -> dict:
    return {"kernel": "sample", **sample.sample_launch(op.ins[0].type.shape[0], t)}


def _step_end(op: Op, t: Target) -> dict:
    return {"kernel": "step_end", **sample.step_end_launch(op.ins[3].type.shape[0], t)}


def _concat(op: Op, t: Target) -> dict:
    xs, ys = op.ins[0].type.shape, op.ins[1].type.shape
    rows = xs[0] if len(xs) == 2 else 1
    return {"kernel": "concat", **mtp.concat_launch(rows, xs[-1], ys[-1], t)}


def _embedding_next_rows(op: Op, t: Target) -> dict:
    rows, h = op.outs[0].type.shape
    return {"kernel": f"embedding_next_rows_{op.ins[0].type.dtype}",
            **embedding.embedding_rows_launch(rows, h, op.ins[1].type.shape[0], t)}


def _spec_scalar(kind: str, **consts):
    def rule(op: Op, t: Target) -> dict:
        launch = speculative.scalar_launch(t)
        c = {k: f(op) for k, f in consts.items()}
        return {"kernel": kind, **launch, "constexprs": {**launch["constexprs"], **c}}
    return rule


def _argmax_rows(op: Op, t: Target) -> dict:
    return {"kernel": "argmax_rows", **speculative.argmax_rows_launch(*op.ins[0].type.shape, t)}


def _spec_filter(op: Op, t: Target) -> dict:
    shape = op.ins[0].type.shape
    rows = shape[0] if len(shape) == 2 else 1
    return {"kernel": "spec_filter", **speculative.spec_filter_launch(rows, shape[-1], t)}


def _spec_sample_rows(op: Op, t: Target) -> dict:
    rows, vocab = op.ins[0].type.shape
    launch = speculative.spec_rows_launch(rows, vocab, t)
    return {"kernel": "spec_sample_rows", **launch,
            "constexprs": {**launch["constexprs"], "K": rows - 1, "S": op.ins[3].type.shape[0]}}


def _draft_sample(op: Op, t: Target) -> dict:
    return {"kernel": "draft_sample", **speculative.spec_rows_launch(1, op.ins[0].type.shape[0], t)}


def _draft_sample_ref(logits, draft, temperature, top_p, top_k, min_p, seed, dpos, q, partials, tickets, row):
    """draft_sample_ref; the partials and tickets are the GPU kernels' scratch."""
    return speculative.draft_sample_ref(logits, draft, temperature, top_p, top_k, min_p, seed, dpos, q, row)


def _spec_sample_rows_ref(logits, greedy, q, tokens, replay, pos, temperature, top_p, top_k, min_p, seed, replay_on,
                          partials, tickets):
    """spec_sample_rows_ref; the partials and tickets are the GPU kernels' scratch."""
    return speculative.spec_sample_rows_ref(logits, greedy, q, tokens, replay, pos, temperature, top_p, top_k, min_p,
                                            seed, replay_on)


def _gdn_rows_delta_snap(op: Op, t: Target) -> dict:
    """gdn_rows_delta's launch, row by row (chunk 0: each row's update is in registers)."""
    return {**_gdn_rows_delta(op, t, chunk=0, snap=True), "kernel": "gdn_rows_delta_snap"}


def _gdn_rows_norm_snap(op: Op, t: Target) -> dict:
    return {**_gdn_rows_norm(op, t, snap=True), "kernel": "gdn_rows_norm_snap"}


def _gdn_commit(op: Op, t: Target) -> dict:
    rec, rec_rows, conv_state = op.ins[0], op.ins[1], op.ins[2]
    hv, dk, dv = rec.type.shape
    c, kc1 = conv_state.type.shape
    rows, width = rec_rows.type.shape
    return {"kernel": "gdn_commit",
            **gated_delta.gdn_commit_launch(gated_delta.update_row_keys(width, hv, dk, dv), hv, dk, dv, c, kc1 + 1,
                                            rows, t)}


# --- ONNX lowerings: each emits what the op's reference computes (primitives: onnx_export._Exporter) ---

def _onnx_embedding(ex, op, table, tok):  # embedding_ref: row token, as fp32
    t = ex.weight_init(table)
    row = ex.reshape(ex.g.node("Gather", [t, ex.dyn(tok)], axis=0), [table.type.shape[1]])
    return row if table.type.dtype == "f32" else ex.cast(row, "f32")


def _onnx_conv1d_step(ex, op, x, st, w):  # conv1d_step_ref: output, then the shift
    window = ex.conv_window(ex.f32(x), st)
    out = ex.conv1d(window, w, op.attrs["act"])
    ex.conv_shift(window, st)
    return out


def _onnx_sample(ex, op, logits, *ignored):  # greedy: sample_ref at temperature 0
    ex.next_token = ex.g.node("ArgMax", [ex.f32(logits)], axis=0, keepdims=1, select_last_index=0)


def _onnx_embedding_rmsnorm(ex, op, table, tok, w):
    x = _onnx_embedding(ex, op, table, tok)
    return x, ex.rmsnorm(x, ex.f32(w), op.attrs["eps"])


def _onnx_add_rmsnorm(ex, op, x, y, w):
    s = ex.g.node("Add", [ex.f32(x), ex.f32(y)])
    return s, ex.rmsnorm(s, ex.f32(w), op.attrs["eps"])


def _onnx_matmul_swiglu(ex, op, x, wg, wu):
    x = ex.f32(x)
    return ex.g.node("Mul", [ex.silu(ex.matmul(x, wg)), ex.matmul(x, wu)])


def _residual_partials(ex, op, s: str):
    """(s, ss): ss the sums of s^2 over groups of partial_rows rows (ReduceSumSquare), the next norm's partials."""
    n, rows = op.outs[0].type.shape[0], op.attrs["partial_rows"]
    if n % rows:
        raise IRError(f"{op.kind}: ONNX export needs partial_rows ({rows}) to divide the rows ({n})")
    return s, ex.reduce("ReduceSumSquare", ex.reshape(s, [n // rows, rows]), 1, 0)


def _onnx_matmul_add(ex, op, x, w, r):  # s = r + W x, and its partial sums of squares
    return _residual_partials(ex, op, ex.g.node("Add", [ex.f32(r), ex.matmul(ex.f32(x), w)]))


def _onnx_rmsnorm_matmul(ex, op, s, ss, nw, *ws):  # the partials are the GPU's way to the mean: unused
    n = ex.rmsnorm(ex.f32(s), ex.f32(nw), op.attrs["eps"])
    if len(ws) == 2:
        return ex.g.node("Mul", [ex.silu(ex.matmul(n, ws[0])), ex.matmul(n, ws[1])])
    return ex.matmul(n, ws[0])


def _onnx_gdn_delta(ex, op, qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec):
    hk, hv, _, dv = gdn_layer_heads(qkv, rec)
    mixed = ex.conv1d(ex.conv_window(ex.f32(qkv), conv_state), conv_w, "silu")  # state only read
    o = ex.gdn_core(hk, ex.f32(b), ex.f32(a), mixed, a_log, dt_bias, rec, op.attrs["l2_eps"], op.attrs["scale"])
    return ex.reshape(o, [hv * dv])


def _onnx_gdn_norm(ex, op, o_raw, z, qkv, norm_w, conv_state):
    (dv,), (n,) = norm_w.type.shape, o_raw.type.shape
    out = ex.gated_rmsnorm(ex.reshape(ex.f32(o_raw), [n // dv, dv]), ex.reshape(ex.f32(z), [n // dv, dv]),
                           ex.f32(norm_w), op.attrs["eps"])
    ex.conv_shift(ex.conv_window(ex.f32(qkv), conv_state), conv_state)
    return ex.reshape(out, [n])


def _onnx_gdn_step(ex, op, qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec):
    hk, hv, _, dv = gdn_layer_heads(qkv, rec)
    window = ex.conv_window(ex.f32(qkv), conv_state)
    mixed = ex.conv1d(window, conv_w, "silu")
    ex.conv_shift(window, conv_state)
    o = ex.gdn_core(hk, ex.f32(b), ex.f32(a), mixed, a_log, dt_bias, rec, op.attrs["l2_eps"], op.attrs["scale"])
    out = ex.gated_rmsnorm(o, ex.reshape(ex.f32(z), [hv, dv]), ex.f32(norm_w), op.attrs["eps"])
    return ex.reshape(out, [hv * dv])


def _onnx_topk(ex, op, logits: str):
    """moe_topk_ref of an fp32 logits tensor: softmax, TopK (ONNX ranks equal values lower index first: the
    reference's tie rule), the weights divided by their sum in rank order when norm_topk; ids as the IR's i32."""
    g, k = ex.g, op.attrs["top_k"]
    vals, ids = g.node_outs("TopK", [g.node("Softmax", [logits], axis=-1), g.i64([k])], 2, axis=-1, largest=1,
                            sorted=1)
    if op.attrs["norm_topk"]:
        vals = g.node("Div", [vals, ex.unsqueeze(ex.rank_sum(vals, k, -1), [-1])])
    return ex.cast(ids, "i32"), vals


def _onnx_moe_topk(ex, op, logits):
    return _onnx_topk(ex, op, ex.f32(logits))


def _onnx_moe_router(ex, op, x, w):  # moe_router_ref: the logits as matmul's, then moe_topk's
    return _onnx_topk(ex, op, ex.matmul(ex.f32(x), w))


def _one_token(op, x) -> None:
    if len(x.type.shape) != 1:
        raise IRError(f"{op.kind}: the ONNX step is the one-token step (input {list(x.type.shape)})")


def _onnx_gate_up(ex, x: str, ids, wg, wu, sg, su, sgate, experts: int) -> str:
    """moe_gate_up_ref of an fp32 x [H]: [silu(Wg_e x) * (Wu_e x) for e in ids] | silu(Sg x) * (Su x) | Ws . x,
    each routed expert's rows gathered from the stacked matrices by the routing ids."""
    g, (k,) = ex.g, ids.type.shape
    gate, up = (g.node("MatMul", [ex.expert_rows(w, ids, experts), x]) for w in (wg, wu))  # [k, I]
    routed = ex.reshape(g.node("Mul", [ex.silu(gate), up]), [k * (wg.type.shape[0] // experts)])
    shared = g.node("Mul", [ex.silu(ex.matmul(x, sg)), ex.matmul(x, su)])
    return g.node("Concat", [routed, shared, ex.matmul(x, sgate)], axis=0)


def _onnx_moe_gate_up(ex, op, x, ids, wg, wu, sg, su, sgate):
    _one_token(op, x)
    return _onnx_gate_up(ex, ex.f32(x), ids, wg, wu, sg, su, sgate, op.attrs["experts"])


def _onnx_rmsnorm_moe_gate_up(ex, op, s, ss, nw, ids, wg, wu, sg, su, sgate):  # ss: the GPU's way to the mean
    _one_token(op, s)
    n = ex.rmsnorm(ex.f32(s), ex.f32(nw), op.attrs["eps"])
    return _onnx_gate_up(ex, n, ids, wg, wu, sg, su, sgate, op.attrs["experts"])


def _onnx_down(ex, a: str, ids, weights, wd, sd) -> str:
    """moe_down_ref of an fp32 act: sum_j weights_j (Wd_{ids_j} act_j) in rank order + sigmoid(act[-1]) (Sd act_s)."""
    g = ex.g
    (h, s), (k,), inter = sd.type.shape, ids.type.shape, wd.type.shape[1]
    routed = ex.reshape(ex.slice(a, 0, 0, k * inter), [k, inter, 1])
    prod = ex.reshape(g.node("MatMul", [ex.expert_rows(wd, ids, wd.type.shape[0] // h), routed]), [k, h])
    y = ex.rank_sum(g.node("Mul", [prod, ex.reshape(ex.f32(weights), [k, 1])]), k, 0)
    shared = ex.matmul(ex.slice(a, 0, k * inter, k * inter + s), sd)
    gate = g.node("Sigmoid", [ex.slice(a, 0, k * inter + s, k * inter + s + 1)])
    return g.node("Add", [y, g.node("Mul", [gate, shared])])


def _onnx_moe_down(ex, op, act, ids, weights, wd, sd):
    _one_token(op, act)
    return _onnx_down(ex, ex.f32(act), ids, weights, wd, sd)


def _onnx_moe_down_add(ex, op, act, ids, weights, wd, sd, r):  # s = r + moe_down; ss as matmul_add's
    _one_token(op, act)
    y = _onnx_down(ex, ex.f32(act), ids, weights, wd, sd)
    return _residual_partials(ex, op, ex.g.node("Add", [ex.f32(r), y]))


def _onnx_moe_experts(ex, op, x, ids, weights, wg, wu, wd, sg, su, sd, sgate):  # moe_experts_ref: down(gate_up)
    _one_token(op, x)
    experts = wd.type.shape[0] // x.type.shape[0]
    act = _onnx_gate_up(ex, ex.f32(x), ids, wg, wu, sg, su, sgate, experts)
    return _onnx_down(ex, act, ids, weights, wd, sd)


def _onnx_attn_step(ex, op, qg, k, v, qn, kn, kc, vc, pos, *scratch):  # attn_step_ref (the split: a GPU detail)
    nh, hkv, d = attn_heads(op)
    a, p = op.attrs, ex.dyn(pos)
    qg2 = ex.reshape(ex.f32(qg), [nh, 2 * d])
    q = ex.rope(ex.rmsnorm(ex.slice(qg2, 1, 0, d), ex.f32(qn), a["eps"]), d, p, a["theta"], a["rotary_dim"],
                a.get("yarn"))
    kr = ex.rope(ex.rmsnorm(ex.reshape(ex.f32(k), [hkv, d]), ex.f32(kn), a["eps"]), d, p, a["theta"],
                 a["rotary_dim"], a.get("yarn"))
    ex.kv_append(kc, vc, kr, ex.reshape(ex.f32(v), [hkv, d]), p)
    o = ex.reshape(ex.attention(q, nh, kc, vc, p, a["scale"]), [nh * d])
    gate = ex.reshape(ex.slice(qg2, 1, d, 2 * d), [nh * d])
    return ex.g.node("Mul", [o, ex.g.node("Sigmoid", [gate])])


def _attn_step_ref(qg, k, v, qn, kn, kc, vc, pos, partials, tickets, **attrs):
    return attention.attn_step_ref(qg, k, v, qn, kn, kc, vc, pos, **attrs)  # the split is a GPU detail


def _attn_rows_q_ref(x, qn, kc, vc, pos, n_prompt, partials, tickets, **attrs):
    return attention.attn_rows_q_ref(x, qn, kc, vc, pos, n_prompt, **attrs)  # the split is a GPU detail


def _rows_of(x) -> int:
    return x.type.shape[0] if len(x.type.shape) == 2 else 1


def _group(w) -> int:
    return q4_group(w.type.dtype) if is_q4(w.type.dtype) else 0


def _moe_topk(op: Op, t: Target) -> dict:
    (logits,) = op.ins
    return {"kernel": "moe_topk", **moe.moe_topk_launch(_rows_of(logits), logits.type.shape[-1], op.attrs["top_k"], t)}


def _moe_gate_up(op: Op, t: Target) -> dict:
    x, ids, wg, wu, sg, su, sgate = op.ins
    e = op.attrs["experts"]
    dtypes = "_".join(dict.fromkeys([wg.type.dtype, sg.type.dtype, sgate.type.dtype]))
    return {"kernel": "moe_gate_up_" + dtypes,
            **moe.moe_gate_up_launch(_rows_of(x), e, x.type.shape[-1], wg.type.shape[0] // e, sg.type.shape[0],
                                     ids.type.shape[-1], (_group(wg), _group(sg), _group(sgate)), t)}


def _rmsnorm_moe_gate_up(op: Op, t: Target) -> dict:
    """moe_gate_up's launch with the producer's partials (operand 1)."""
    s, ss, nw, ids, wg, wu, sg, su, sgate = op.ins
    e = op.attrs["experts"]
    dtypes = "_".join(dict.fromkeys([wg.type.dtype, sg.type.dtype, sgate.type.dtype]))
    return {"kernel": "rmsnorm_moe_gate_up_" + dtypes,
            **moe.moe_gate_up_launch(1, e, s.type.shape[-1], wg.type.shape[0] // e, sg.type.shape[0],
                                     ids.type.shape[-1], (_group(wg), _group(sg), _group(sgate)), t,
                                     partials=ss.type.shape[0])}


def _moe_down(op: Op, t: Target) -> dict:
    """moe_down's (and moe_down_add's: partial_rows, select_kernels sets it, is its BLOCK_N) launch."""
    act, ids, wts, wd, sd = op.ins[:5]
    h, s = sd.type.shape
    dtypes = "_".join(dict.fromkeys([wd.type.dtype, sd.type.dtype]))
    return {"kernel": ("moe_down_add_" if op.kind == "moe_down_add" else "moe_down_") + dtypes,
            **moe.moe_down_launch(_rows_of(act), wd.type.shape[0] // h, h, wd.type.shape[1], s, ids.type.shape[-1],
                                  (_group(wd), _group(sd)), t)}


def _moe_group(op: Op, t: Target) -> dict:
    (ids,) = op.ins
    return {"kernel": "moe_group", **moe.moe_group_launch(math.prod(ids.type.shape), op.attrs["experts"],
                                                          ids.type.shape[1], op.attrs["chunk"], t)}


def moe_grouped_rows(e: int, wg: Weight, wd: Weight, t: Target) -> int:
    """Sorted pairs a chunk of the grouped experts (stacked gate / up ``wg`` [E I, H], down ``wd`` [E H, I])
    holds on ``t``: the tensor-core q4 kernel's chunk where both products run it (kernels/q4_mma.py), else the
    few-rows matvec's (moe.GROUPED_CHUNK)."""
    if not (is_q4(wg.type.dtype) and is_q4(wd.type.dtype)):
        return moe.GROUPED_CHUNK
    inter, hidden = wg.type.shape[0] // e, wg.type.shape[1]
    return q4_mma.grouped_rows(e, inter, hidden, (_group(wg), _group(wd)), t) or moe.GROUPED_CHUNK


def _moe_grouped(op: Op, t: Target) -> dict:
    """moe_gate_up_grouped's and moe_down_grouped's launch: the tensor-core q4 kernel where chunks hold more
    pairs than the few-rows matvec takes (select_kernels chose so: moe_grouped_rows), else the few-rows tiles
    of one expert's matrix."""
    e = op.attrs["experts"]
    gate_up = op.kind == "moe_gate_up_grouped"
    w = op.ins[3] if gate_up else op.ins[2]
    chunks = op.ins[2] if gate_up else op.ins[1]
    pairs = op.outs[0].type.shape[0]
    n, k = w.type.shape[0] // e, w.type.shape[1]
    rows = op.attrs["chunk"]
    if rows > moe.GROUPED_CHUNK:
        kind = "q4mma_gate_up_grouped_" if gate_up else "q4mma_down_grouped_"
        return {"kernel": kind + w.type.dtype,
                **q4_mma.grouped_launch(pairs, e, n, k, _group(w), chunks.type.shape[0], t, gate_up)}
    return {"kernel": f"{op.kind}_{w.type.dtype}",
            **moe.moe_grouped_launch(pairs, e, n, k, _group(w), moe.GROUPED_CHUNK, t, pair=gate_up)}


def _moe_combine(op: Op, t: Target) -> dict:
    m, k = op.ins[2].type.shape
    return {"kernel": f"moe_combine_{op.ins[4].type.dtype}", **moe.moe_combine_launch(m, op.ins[3].type.shape[1], k, t)}


def _leading_slice(op: Op) -> bool:
    return all(d == 1 for d in op.ins[0].type.shape[:op.attrs["axis"]])


_IN_GDN = NotApplicable("the GPU runs it inside gdn_delta + gdn_norm (fuse)")
_ROWS_ONNX = NotApplicable("the ONNX step is the one-token step")
_IN_ATTN = NotApplicable("the GPU runs it inside attn_step (fuse)")
_ROPE_OPTIONS = ("yarn",)  # YaRN: [factor, ramp low, ramp span, attention factor] (ModelConfig.rope_yarn)
_VIEW = NotApplicable("a view: the result aliases its input, no data moves")
_SPEC_ONNX = NotApplicable("part of the speculative programs; the ONNX step is the one-token step")

OPS: dict[str, OpDef] = {d.name: d for d in (
    OpDef("embedding", "wd", (), _infer_embedding, embedding.embedding_ref,
          NotApplicable("the GPU runs it inside embedding_rmsnorm, with the norm after it (fuse)"),
          _onnx_embedding, doc="row `token` of the table"),
    OpDef("rmsnorm", "tw", ("eps",), _infer_rmsnorm, rmsnorm.rmsnorm_ref, Kernel(rmsnorm.rmsnorm_kernel, _rmsnorm),
          lambda ex, op, x, w: ex.rmsnorm(ex.f32(x), ex.f32(w), op.attrs["eps"]),
          doc="x * rsqrt(mean(x^2) + eps) * (1 + w), fp32, last axis"),
    OpDef("matmul", "vw", (), _infer_matmul, matvec.matvec_ref,
          Kernel(matvec.matvec_kernel, _matvec, rows=gemm.gemm_kernel,
                 variants=(("matvec_rows_", matvec.matvec_rows_kernel), ("q4mma_rows_", q4_mma.q4mma_rows),
                           ("bf16mma_rows_", bf16_mma.bf16mma_rows), ("q4stream_", q4_stream.q4stream))),
          lambda ex, op, x, w: ex.matmul(ex.f32(x), w), doc="W @ x (W is [out, in])"),
    OpDef("add", "vv", (), _infer_same, elementwise.add_ref, NotApplicable("the GPU runs it inside add_rmsnorm (fuse)"),
          lambda ex, op, a, b: ex.g.node("Add", [ex.f32(a), ex.f32(b)]), doc="a + b"),
    OpDef("reshape", "v", ("shape",), _infer_reshape, elementwise.reshape_ref, _VIEW,
          lambda ex, op, x: ex.reshape(ex.f32(x), op.attrs["shape"]), view=lambda op: True),
    OpDef("slice", "v", ("axis", "start", "stop"), _infer_slice, elementwise.slice_ref,
          NotApplicable("a view when it takes a leading range; other slices are fused away"),
          lambda ex, op, x: ex.slice(ex.f32(x), op.attrs["axis"], op.attrs["start"], op.attrs["stop"]),
          view=_leading_slice),
    OpDef("conv1d_step", "vsw", ("act",), _infer_conv1d_step, gated_delta.conv1d_step_ref, _IN_GDN, _onnx_conv1d_step,
          inout=(1,), doc="depthwise causal conv over [state | x], then act; state keeps the last K-1 inputs"),
    OpDef("l2norm", "v", ("eps",), _infer_same, elementwise.l2norm_ref, _IN_GDN,
          lambda ex, op, x: ex.l2norm(ex.f32(x), op.attrs["eps"]), doc="x * rsqrt(sum(x^2) + eps), last axis"),
    OpDef("gdn_gates", "vvww", (), _infer_gdn_gates, gated_delta.gdn_gates_ref, _IN_GDN,
          lambda ex, op, a, b, a_log, dt_bias: ex.gates(ex.f32(a), ex.f32(b), a_log, dt_bias),
          doc="g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b)"),
    OpDef("gated_delta_step", "vvvvvs", ("scale",), _infer_gated_delta, gated_delta.gated_delta_step_ref, _IN_GDN,
          lambda ex, op, q, k, v, g, beta, st: ex.delta_rule(ex.f32(q), ex.f32(k), ex.f32(v), ex.f32(g), ex.f32(beta),
                                                             st, q.type.shape[0], op.attrs["scale"]),
          inout=(5,), doc="S = S*exp(g); S += k (x) beta*(v - S^T k); o = S^T (q*scale)"),
    OpDef("gated_rmsnorm", "vvw", ("eps",), _infer_gated_rmsnorm, rmsnorm.gated_rmsnorm_ref, _IN_GDN,
          lambda ex, op, x, z, w: ex.gated_rmsnorm(ex.f32(x), ex.f32(z), ex.f32(w), op.attrs["eps"]),
          doc="w * rmsnorm(x) * silu(z), per head"),
    OpDef("rope", "vd", ("theta", "rotary_dim"), _infer_rope, attention.rope_ref, _IN_ATTN,
          lambda ex, op, x, pos: ex.rope(ex.f32(x), x.type.shape[1], ex.dyn(pos), op.attrs["theta"],
                                         op.attrs["rotary_dim"], op.attrs.get("yarn")),
          options=_ROPE_OPTIONS, doc="NeoX rotary on the first rotary_dim dims at pos (YaRN's with ``yarn``)"),
    OpDef("kv_append", "ssvvd", (), _infer_kv_append, attention.kv_append_ref, _IN_ATTN,
          lambda ex, op, kc, vc, k, v, pos: ex.kv_append(kc, vc, ex.f32(k), ex.f32(v), ex.dyn(pos)),
          inout=(0, 1), doc="caches[pos] = k, v"),
    OpDef("attention", "vssd", ("scale",), _infer_attention, attention.attention_ref, _IN_ATTN,
          lambda ex, op, q, kc, vc, pos: ex.attention(ex.f32(q), q.type.shape[0], kc, vc, ex.dyn(pos),
                                                      op.attrs["scale"]),
          doc="softmax(q K[0..pos]^T * scale) V, GQA"),
    OpDef("sigmoid_gate", "vv", (), _infer_same, elementwise.sigmoid_gate_ref, _IN_ATTN,
          lambda ex, op, x, gate: ex.g.node("Mul", [ex.f32(x), ex.g.node("Sigmoid", [ex.f32(gate)])]),
          doc="x * sigmoid(gate)"),
    OpDef("swiglu", "vv", (), _infer_same, elementwise.swiglu_ref,
          NotApplicable("the GPU runs it inside matvec_swiglu (fuse: matmul_swiglu)"),
          lambda ex, op, gate, up: ex.g.node("Mul", [ex.silu(ex.f32(gate)), ex.f32(up)]), doc="silu(gate) * up"),
    OpDef("sample", "vddddddss", (), _infer_sample, _sample_ref, Kernel(sample.sample_kernel, _sample), _onnx_sample,
          writes_dyn=True, doc="argmax if temperature == 0, else seeded sampling with top-k, top-p and min-p; "
                               "writes dyn.sampled (ONNX: greedy only, as next_token)"),
    OpDef("step_end", "ddds", (), _infer_step_end, sample.step_end_ref, Kernel(sample.step_end_kernel, _step_end),
          NotApplicable("made by hoist_dynamic; the ONNX step is exported before it and the host (or engine "
                        "runner) advances pos"),
          inout=(3,), writes_dyn=True,
          doc="tokens[pos+1] = sampled unless still inside the prompt; token = tokens[pos+1]; pos += 1"),
    # --- fused ops (made by passes/fuse.py) ---
    OpDef("embedding_rmsnorm", "wdw", ("eps",), _infer_embedding_rmsnorm, embedding.embedding_rmsnorm_ref,
          Kernel(embedding.embedding_rmsnorm_kernel, _embedding_rmsnorm), _onnx_embedding_rmsnorm,
          doc="x = row `token` of the table; (x, rmsnorm(x, w))"),
    OpDef("add_rmsnorm", "vvw", ("eps",), _infer_add_rmsnorm, rmsnorm.add_rmsnorm_ref,
          Kernel(rmsnorm.add_rmsnorm_kernel, _rmsnorm), _onnx_add_rmsnorm, doc="s = x + y; (s, rmsnorm(s, w))"),
    OpDef("matmul_swiglu", "vww", (), _infer_matmul_swiglu, matvec.matvec_swiglu_ref,
          Kernel(matvec.matvec_swiglu_kernel, _matvec, rows=gemm.gemm_swiglu_kernel,
                 variants=(("matvec_rows_swiglu_", matvec.matvec_rows_swiglu_kernel),
                           ("q4mma_rows_swiglu_", q4_mma.q4mma_rows_swiglu),
                           ("bf16mma_rows_swiglu_", bf16_mma.bf16mma_rows_swiglu))), _onnx_matmul_swiglu,
          doc="silu(Wg @ x) * (Wu @ x)"),
    OpDef("matmul_add", "vwv", ("partial_rows",), _infer_matmul_add, matvec.matvec_add_ref,
          Kernel(matvec.matvec_add_kernel, _matvec_add,
                 variants=(("q4mma_add_", q4_mma.q4mma_add), ("bf16mma_add_", bf16_mma.bf16mma_add),
                           ("q4stream_add_", q4_stream.q4stream_add))), _onnx_matmul_add,
          doc="s = r + W @ x; ss[i] = sum of s^2 over rows [i*partial_rows, (i+1)*partial_rows) (the next "
              "rmsnorm's partial sums)"),
    OpDef("rmsnorm_matmul", "vvww", ("eps",), _infer_rmsnorm_matmul, matvec.rmsnorm_matvec_ref,
          Kernel(matvec.rmsnorm_matvec_kernel, _rmsnorm_matvec,
                 variants=(("q4mma_norm_", q4_mma.q4mma_norm), ("bf16mma_norm_", bf16_mma.bf16mma_norm),
                           ("q4stream_norm_", q4_stream.q4stream_norm))),
          _onnx_rmsnorm_matmul,
          doc="W @ rmsnorm(s, nw) (the mean square from s, or from matmul_add's partials ss: the kernel's NORM)"),
    OpDef("rmsnorm_matmul_swiglu", "vvwww", ("eps",), _infer_rmsnorm_matmul, matvec.rmsnorm_matvec_swiglu_ref,
          Kernel(matvec.rmsnorm_matvec_swiglu_kernel, _rmsnorm_matvec,
                 variants=(("q4mma_norm_swiglu_", q4_mma.q4mma_norm_swiglu),
                           ("bf16mma_norm_swiglu_", bf16_mma.bf16mma_norm_swiglu),
                           ("q4stream_norm_swiglu_", q4_stream.q4stream_norm_swiglu))), _onnx_rmsnorm_matmul,
          doc="silu(Wg @ n) * (Wu @ n), n = rmsnorm(s, nw) (the mean square as rmsnorm_matmul's)"),
    OpDef("gdn_step", "vvvvswwwws", ("eps", "l2_eps", "scale"), _infer_gdn_step, gated_delta.gdn_step_ref,
          NotApplicable("the GPU runs it as gdn_delta + gdn_norm, which fuse emits (one kernel would race on the "
                        "conv state shared by a key head's value heads)"),
          _onnx_gdn_step, inout=(4, 9),
          doc="conv1d_step+silu, split q|k|v, l2norm q and k, gates, gated_delta_step, gated_rmsnorm"),
    OpDef("gdn_delta", "vvvswwws", ("l2_eps", "scale"), _infer_gdn_delta, gated_delta.gdn_delta_ref,
          Kernel(gated_delta.gdn_delta_kernel, _gdn_delta), _onnx_gdn_delta, inout=(7,),
          doc="conv1d+silu (state only read), split q|k|v, l2norm q and k, gates, gated_delta_step"),
    OpDef("gdn_norm", "vvvws", ("eps",), _infer_gdn_norm, gated_delta.gdn_norm_ref,
          Kernel(gated_delta.gdn_norm_kernel, _gdn_norm), _onnx_gdn_norm, inout=(4,),
          doc="gated_rmsnorm(o, z, w) per head; conv state shifted, qkv appended"),
    # --- the M-row step (a prompt chunk of M rows at positions pos.., valid while < n_prompt) ---
    OpDef("embedding_rows", "wsdd", ("rows",), _infer_embedding_rows, embedding.embedding_rows_ref,
          Kernel(embedding.embedding_rows_kernel, _embedding_rows), _ROWS_ONNX,
          doc="row r: the embedding of tokens[pos + r] while pos + r < n_prompt, zeros after"),
    OpDef("gdn_rows", "vvvswwwsdd", ("l2_eps", "scale"), _infer_gdn_rows, gated_delta.gdn_rows_ref,
          NotApplicable("the GPU runs it as gdn_rows_delta + gdn_rows_norm, which fuse emits"),
          _ROWS_ONNX, inout=(3, 7), doc="the Gated DeltaNet mixer (before its norm) over the chunk's valid rows in "
          "order: conv window and fp32 state advanced per row"),
    OpDef("attn_rows", "vvvwwssdd", ("eps", "theta", "rotary_dim", "scale"), _infer_attn_rows,
          attention.attn_rows_ref,
          NotApplicable("the GPU runs it as attn_rows_kv + attn_rows_q, which fuse emits"), _ROWS_ONNX, inout=(5, 6),
          options=_ROPE_OPTIONS, doc="attn_step for each valid row at position pos + r: KV rows appended, causal inside the chunk"),
    # (fused by passes/fuse.py: the row ops reading the fused projection rows by column offsets)
    OpDef("gdn_rows_delta", "vswwwsdd", ("qkv", "b", "a", "l2_eps", "scale"), _infer_gdn_rows_delta,
          gated_delta.gdn_rows_delta_ref, Kernel(gated_delta.gdn_rows_delta_kernel, _gdn_rows_delta), _ROWS_ONNX,
          inout=(5,),
          doc="gdn_rows before its norm, on the projection rows x (qkv, b, a: column offsets); the conv state "
              "only read"),
    OpDef("gdn_rows_norm", "vvwsdd", ("z", "qkv", "eps"), _infer_gdn_rows_norm, gated_delta.gdn_rows_norm_ref,
          Kernel(gated_delta.gdn_rows_norm_kernel, _gdn_rows_norm), _ROWS_ONNX, inout=(3,),
          doc="gated_rmsnorm of every row per value head (z: x's column offset); the conv state advanced by the "
              "valid rows"),
    OpDef("attn_rows_kv", "vwssdd", ("k", "v", "eps", "theta", "rotary_dim"), _infer_attn_rows_kv,
          attention.attn_rows_kv_ref, Kernel(attention.attn_rows_kv_kernel, _attn_rows_kv), _ROWS_ONNX, inout=(2, 3),
          options=_ROPE_OPTIONS, doc="the valid rows' k (rmsnorm, rope at pos + r) and v appended to the caches"),
    OpDef("attn_rows_q", "vwssddss", ("q", "heads", "eps", "theta", "rotary_dim", "scale"), _infer_attn_rows_q,
          _attn_rows_q_ref, Kernel(attention.attn_rows_q_kernel, _attn_rows_q,
                                   variants=(("attn_rows_step_", attention.attn_rows_step_kernel),)),
          _ROWS_ONNX, inout=(6, 7), options=_ROPE_OPTIONS,
          doc="after attn_rows_kv: each valid row's q (rmsnorm, rope) over cache rows 0..pos + r, sigmoid gate "
              "(split over the sequence where the rows are few: partials and tickets in scratch states)"),
    OpDef("last_row", "vdd", (), _infer_last_row, sample.last_row_ref, Kernel(sample.last_row_kernel, _last_row),
          _ROWS_ONNX,
          doc="the chunk's last valid row"),
    OpDef("chunk_last", "dd", ("rows",), _infer_chunk_last, sample.chunk_last_ref,
          Kernel(sample.chunk_last_kernel, _chunk_last), _ROWS_ONNX,
          writes_dyn=True, doc="dyn.last = the position of the chunk's last valid row (the sampling position)"),
    OpDef("prefill_end", "ddds", ("rows",), _infer_prefill_end, sample.prefill_end_ref,
          Kernel(sample.prefill_end_kernel, _prefill_end), _ROWS_ONNX,
          inout=(3,), writes_dyn=True, doc="pos advances past the chunk's valid rows; after the prompt's last "
          "chunk the sampled token is appended to tokens and fed in (step_end at the last row)"),
    OpDef("attn_step", "vvvwwssdss", ("eps", "theta", "rotary_dim", "scale"), _infer_attn_step, _attn_step_ref,
          Kernel(attention.attn_step_kernel, _attn_step), _onnx_attn_step, inout=(5, 6, 8, 9), options=_ROPE_OPTIONS,
          doc="split q|gate per head, q/k rmsnorm, rope, kv_append, attention (split over the sequence: "
              "partials and tickets in scratch states), sigmoid gate"),
    # --- the speculative iteration (--speculative mtp: compiler/qwen3_5.py lower_speculative) ---
    OpDef("concat", "vv", (), _infer_concat, mtp.concat_ref, Kernel(mtp.concat_kernel, _concat), _SPEC_ONNX,
          doc="[.., A] | [.., B] -> [.., A + B] (the MTP head's [embedding | hidden] join)"),
    OpDef("embedding_next_rows", "wsddd", ("rows",), _infer_embedding_next_rows, embedding.embedding_next_rows_ref,
          Kernel(embedding.embedding_next_rows_kernel, _embedding_next_rows), _SPEC_ONNX,
          doc="row r (valid while pos + r < bound): the embedding of tokens[pos + r + 1], or of sampled at the "
              "bound's last row (the MTP head's input tokens)"),
    OpDef("spec_begin", "d", ("rows",), _infer_spec_begin, speculative.spec_begin_ref,
          Kernel(speculative.spec_begin_kernel, _spec_scalar("spec_begin")), _SPEC_ONNX, writes_dyn=True,
          doc="dyn.vend = pos + rows: the verify's K + 1 rows are valid"),
    OpDef("argmax_rows", "v", (), _infer_argmax_rows, speculative.argmax_rows_ref,
          Kernel(speculative.argmax_rows_kernel, _argmax_rows), _SPEC_ONNX,
          doc="each row's greedy choice (the first index among equal maxima), i32[R]"),
    OpDef("accept", "vds", (), _infer_accept, speculative.accept_ref,
          Kernel(speculative.accept_kernel, _spec_scalar(
              "accept", R=lambda op: op.ins[0].type.shape[0], S=lambda op: op.ins[2].type.shape[0],
              BLOCK_R=lambda op: max(2, 1 << (op.ins[0].type.shape[0] - 1).bit_length()))),
          _SPEC_ONNX, inout=(2,), writes_dyn=True,
          doc="drafts tokens[pos+1..pos+K] accepted while equal to the target's choices; tokens[pos+a+1] = the "
              "target's token at row a; writes npos = pos+a+1, dpos = pos+a, sampled = that token, accepted = a"),
    OpDef("spec_filter", "vddddss", (), _infer_spec_filter, speculative.spec_filter_ref,
          Kernel(speculative.spec_filter_kernel, _spec_filter), _SPEC_ONNX, inout=(5, 6),
          doc="temperature > 0: each row's filtered distribution (top-k, top-p, min-p: the kept set as the "
              "order's prefix, and its normaliser), many programs a row, into the scratch that draft_sample / "
              "spec_sample_rows read next (the CPU path keeps nothing: their references filter)"),
    OpDef("draft_sample", "vdddddddsss", ("row",), _infer_draft_sample, _draft_sample_ref,
          Kernel(speculative.draft_sample_kernel, _draft_sample), _SPEC_ONNX, inout=(8, 9, 10), writes_dyn=True,
          doc="temperature > 0: q = the filtered distribution of the head's logits (spec_filter's), kept as "
              "q[row]; the draft drawn from it (spec_uniform(seed, dpos + 2, DRAFT)); temperature 0: the greedy "
              "draft stands"),
    OpDef("spec_sample_rows", "vvsssdddddddss", (), _infer_spec_sample_rows, _spec_sample_rows_ref,
          Kernel(speculative.spec_sample_rows_kernel, _spec_sample_rows), _SPEC_ONNX, inout=(12, 13),
          doc="each verified row's token for accept: temperature 0 the greedy choice; else (after spec_filter) "
              "draft r accepted with probability min(1, p/q), else a draw from max(0, p - q); row K a draw from "
              "p; with dyn.replay the replayed tokens (controlled acceptance)"),
    OpDef("replay_drafts", "ddddss", ("rows", "vocab"), _infer_replay_drafts, speculative.replay_drafts_ref,
          Kernel(speculative.replay_drafts_kernel, _spec_scalar(
              "replay_drafts", S=lambda op: op.ins[5].type.shape[0],
              BLOCK_R=lambda op: max(2, 1 << (op.attrs["rows"] - 1).bit_length()))),
          _SPEC_ONNX, inout=(5,),
          doc="with dyn.replay: the drafts tokens[pos+1..pos+K] <- the replayed tokens, each corrupted with "
              "probability 1 - replay_accept (controlled acceptance)"),
    OpDef("draft_end", "ddds", (), _infer_draft_end, speculative.draft_end_ref,
          Kernel(speculative.draft_end_kernel, _spec_scalar("draft_end", S=lambda op: op.ins[3].type.shape[0])),
          _SPEC_ONNX, inout=(3,), writes_dyn=True,
          doc="tokens[dpos + 2] = draft unless a prompt position; dpos += 1"),
    OpDef("spec_end", "dd", (), _infer_spec_end, speculative.spec_end_ref,
          Kernel(speculative.spec_end_kernel, _spec_scalar("spec_end")), _SPEC_ONNX, writes_dyn=True,
          doc="pos = npos; token = sampled: the iteration ends where the one-token step would be"),
    OpDef("gdn_rows_snap", "vvvswwwsddss", ("l2_eps", "scale"), _infer_gdn_rows_snap, gated_delta.gdn_rows_snap_ref,
          NotApplicable("the GPU runs it as gdn_rows_delta_snap + gdn_rows_norm_snap, which fuse emits"), _SPEC_ONNX,
          inout=(3, 10, 11), doc="gdn_rows for the speculative verify: the recurrent state only read, each valid "
          "row's update kept (decay, keys, delta) and the conv window after each valid row but the last"),
    OpDef("gdn_rows_delta_snap", "vswwwsdds", ("qkv", "b", "a", "l2_eps", "scale"), _infer_gdn_rows_delta_snap,
          gated_delta.gdn_rows_delta_snap_ref,
          Kernel(gated_delta.gdn_rows_delta_snap_kernel, _gdn_rows_delta_snap), _SPEC_ONNX, inout=(8,),
          doc="gdn_rows_delta (row by row) storing each valid row's update instead of the recurrent state"),
    OpDef("gdn_rows_norm_snap", "vvwsdds", ("z", "qkv", "eps"), _infer_gdn_rows_norm_snap,
          gated_delta.gdn_rows_norm_snap_ref,
          Kernel(gated_delta.gdn_rows_norm_snap_kernel, _gdn_rows_norm_snap), _SPEC_ONNX, inout=(3, 6),
          doc="gdn_rows_norm storing the conv window after each valid row but the last"),
    # --- Qwen3-Next's mixture-of-experts MLP (kernels/moe.py: semantics, routing buffer, tie rule) ---
    OpDef("moe_router", "vw", ("top_k", "norm_topk"), _infer_moe_router, moe.moe_router_ref,
          NotApplicable("the GPU runs it as the router's matmul (the logits) + moe_topk, which fuse emits"), _onnx_moe_router,
          doc="the routing buffer: the top_k experts of softmax(Wr @ x) (i32 ids, largest first, lower index "
              "first among ties) and their f32 weights (renormalised to sum 1 when norm_topk)"),
    OpDef("moe_topk", "v", ("top_k", "norm_topk"), _infer_moe_topk, moe.moe_topk_ref,
          Kernel(moe.moe_topk_kernel, _moe_topk), _onnx_moe_topk,
          doc="moe_router after its logits: the top_k experts of softmax(logits) and their weights (the routing buffer)"),
    OpDef("moe_experts", "vvvwwwwwww", (), _infer_moe_experts, moe.moe_experts_ref,
          NotApplicable("the GPU runs it as moe_gate_up + moe_down, which fuse emits"), _onnx_moe_experts,
          doc="sum_j w_j * down_e(silu(gate_e x) * up_e x) over the routed experts e = ids_j (stacked weights "
              "indexed by the ids read from the routing buffer) + sigmoid(Ws . x) * shared expert(x)"),
    OpDef("moe_gate_up", "vvwwwww", ("experts",), _infer_moe_gate_up, moe.moe_gate_up_ref,
          Kernel(moe.moe_gate_up_kernel, _moe_gate_up), _onnx_moe_gate_up,
          doc="[silu(gate_e x) * (up_e x) for e in ids] | the shared expert's | its gate logit Ws . x"),
    OpDef("moe_down", "vvvww", (), _infer_moe_down, moe.moe_down_ref, Kernel(moe.moe_down_kernel, _moe_down),
          _onnx_moe_down, doc="sum_j w_j * down_{ids_j}(act_j) in rank order + sigmoid(gate logit) * shared down"),
    OpDef("moe_group", "v", ("experts", "chunk"), _infer_moe_group, moe.moe_group_ref, Kernel(moe.moe_group_kernel, _moe_group),
          _ROWS_ONNX, doc="M rows: the (row, slot) pairs sorted by expert (src rows, pos of each pair) and the chunk "
                         "table (expert, first pair, pairs) cutting each expert's run every `chunk` pairs"),
    OpDef("moe_gate_up_grouped", "vvvww", ("experts", "chunk"), _infer_moe_gate_up_grouped, moe.moe_gate_up_grouped_ref,
          Kernel(moe.moe_gate_up_grouped_kernel, _moe_grouped,
                 variants=(("q4mma_gate_up_grouped_", q4_mma.q4mma_gate_up_grouped),)), _ROWS_ONNX,
          doc="M rows grouped: act_s[i] = silu(Wg_e x[src[i]]) * (Wu_e x[src[i]]) per chunk of expert e"),
    OpDef("moe_down_grouped", "vvw", ("experts", "chunk"), _infer_moe_down_grouped, moe.moe_down_grouped_ref,
          Kernel(moe.moe_down_grouped_kernel, _moe_grouped,
                 variants=(("q4mma_down_grouped_", q4_mma.q4mma_down_grouped),)), _ROWS_ONNX,
          doc="M rows grouped: y_s[i] = Wd_e act_s[i] per chunk of expert e"),
    OpDef("moe_combine", "vvvvwv", (), _infer_moe_combine, moe.moe_combine_ref, Kernel(moe.moe_combine_kernel, _moe_combine),
          _ROWS_ONNX, doc="y[r] = sum_j w[r, j] y_s[pos[r k + j]] in rank order + sigmoid(Ws . x[r]) shared[r]"),
    OpDef("moe_down_add", "vvvwwv", ("partial_rows",), _infer_moe_down_add, moe.moe_down_add_ref,
          Kernel(moe.moe_down_add_kernel, _moe_down), _onnx_moe_down_add,
          doc="s = r + moe_down(...); ss: the next rmsnorm's partial sums of s^2 (as matmul_add's)"),
    OpDef("rmsnorm_moe_gate_up", "vvwvwwwww", ("experts", "eps"), _infer_rmsnorm_moe_gate_up,
          moe.rmsnorm_moe_gate_up_ref, Kernel(moe.rmsnorm_moe_gate_up_kernel, _rmsnorm_moe_gate_up),
          _onnx_rmsnorm_moe_gate_up,
          doc="moe_gate_up of rmsnorm(s, nw) (the mean square from moe_down_add's / matmul_add's partials ss)"),
    OpDef("gdn_commit", "ssssdd", (), _infer_gdn_commit, gated_delta.gdn_commit_ref,
          Kernel(gated_delta.gdn_commit_kernel, _gdn_commit), _SPEC_ONNX, inout=(0, 2),
          doc="the recurrent state advanced by the kept rows' updates (kept = npos - pos), the conv window back to "
              "the last kept row's"),
)}


def op_def(kind: str) -> OpDef:
    d = OPS.get(kind)
    if d is None:
        raise IRError(f"unknown op {kind!r}")
    return d


def is_view(op: Op) -> bool:
    """The op moves no data: its result aliases its input (reshape, slices of a leading range)."""
    view = OPS[op.kind].view
    return view is not None and view(op)


def routing_logits(program: Program) -> set[int]:
    """The ids of the values moe_topk turns into routing: the router's logits (after fuse split moe_router)."""
    return {id(op.ins[0]) for op in program.ops if op.kind == "moe_topk"}


def emit(program: Program, kind: str, *ins, out=None, **attrs):
    """Append an op to ``program`` with its inferred result types. Returns the single Value, a tuple,
    or None (no results, or results that are dyn slots: ``out``)."""
    d = op_def(kind)
    out_types = d.infer(list(ins), attrs)
    if d.writes_dyn:
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
    else:
        outs = [Value(t) for t in out_types]
    program.ops.append(Op(kind, outs, list(ins), dict(attrs)))
    if d.writes_dyn or not outs:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)


_OPERAND_CLASS = {"v": (Value,), "w": (Weight,), "s": (State,), "d": (Dyn,), "t": (Value, Weight, State)}
_KIND_NAME = {Value: "value", Weight: "weight", State: "state", Dyn: "dyn slot"}


def scalar_attrs(op: Op) -> list:
    """The kernel's scalar parameters of ``op``: its record's ``attrs``, in that order (``options`` excluded)."""
    return [op.attrs[k] for k in OPS[op.kind].attrs]


def verify(program: Program) -> None:
    """Check every op against its record; every value defined once, before use; outputs defined.
    (Placements are plan_memory's check.) Raises IRError naming the first offending op."""
    defined: set[int] = set()
    for i, op in enumerate(program.ops):
        where = f"op #{i} ({op.kind})"
        spec = OPS.get(op.kind)
        if spec is None:
            raise IRError(f"{where}: unknown op kind")
        if len(op.ins) != len(spec.operands):
            raise IRError(f"{where}: takes {len(spec.operands)} operands, got {len(op.ins)}")
        for j, (x, cls) in enumerate(zip(op.ins, spec.operands)):
            if not isinstance(x, _OPERAND_CLASS[cls]):
                raise IRError(f"{where}: operand {j} is a {_KIND_NAME.get(type(x), type(x).__name__)}, "
                              f"expected {'/'.join(_KIND_NAME[c] for c in _OPERAND_CLASS[cls])}")
            if isinstance(x, Value) and id(x) not in defined:
                raise IRError(f"{where}: operand {j} is used before it is defined")
            if isinstance(x, Weight) and program.weights.get(x.name) is not x:
                raise IRError(f"{where}: weight {x.name!r} is not declared")
            if isinstance(x, State) and program.states.get(x.name) is not x:
                raise IRError(f"{where}: state {x.name!r} is not declared")
            if isinstance(x, Dyn) and program.dyn.get(x.name) is not x:
                raise IRError(f"{where}: dyn slot {x.name!r} is not declared")
        missing = [k for k in spec.attrs if k not in op.attrs]
        extra = [k for k in op.attrs if k not in spec.attrs and k not in spec.options]
        if missing or extra:
            raise IRError(f"{where}: attributes missing {missing} / unexpected {extra}")
        yarn = op.attrs.get("yarn")
        if yarn is not None and not (isinstance(yarn, list) and len(yarn) == 4 and
                                     all(isinstance(v, float) for v in yarn) and yarn[0] >= 1 and yarn[2] > 0):
            raise IRError(f"{where}: yarn must be [factor >= 1, ramp low, ramp span > 0, attention factor], got {yarn}")
        try:
            types = spec.infer(op.ins, op.attrs)
        except IRError as e:
            raise IRError(f"{where}: {e}") from None
        if spec.writes_dyn:
            if not all(isinstance(o, Dyn) and program.dyn.get(o.name) is o for o in op.outs):
                raise IRError(f"{where}: outputs must be declared dyn slots")
            continue
        if len(op.outs) != len(types):
            raise IRError(f"{where}: defines {len(op.outs)} values, expected {len(types)}")
        for o, t in zip(op.outs, types):
            if not isinstance(o, Value):
                raise IRError(f"{where}: outputs must be values")
            if o.type != t:
                raise IRError(f"{where}: result typed {o.type}, shape rule gives {t}")
            if id(o) in defined:
                raise IRError(f"{where}: value defined twice")
            defined.add(id(o))
    for name, v in program.outputs.items():
        if id(v) not in defined:
            raise IRError(f"output {name!r} is not defined by any op")
