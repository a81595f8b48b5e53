"""The step IR: one decode step of the model as a program over statically shaped buffers.

A ``Program`` holds
  * ``dyn``     named 4-byte slots of the device dyn buffer (pos, token, sampled, ...): every value
                that changes from token to token lives here, never in an op's attributes;
  * ``weights`` read-only tensors stored in the artifact, by name;
  * ``states``  persistent buffers that live across steps (conv windows, recurrent states, KV caches,
                the token sequence), and ``scratch.*`` buffers a fused kernel needs within one launch
                (attention partials and tickets: zeroed at reset, left zeroed by every launch);
  * ``ops``     in execution order; each op reads operands (values, weights, states, dyn slots),
                defines new SSA ``Value``s, and may update states or dyn slots in place;
  * ``outputs`` named values the runtime may read back (``hidden``, ``logits``).

Values carry no names: the text printer (``ir_text``) numbers them when it prints, so goldens do
not churn when an unrelated op is added. ``OP_SPECS`` defines, per op kind, its operands, its
attributes and its shape rule; ``verify`` checks a whole program against them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

DTYPES = ("f32", "bf16", "f16", "i32")
TOKENS_STATE = "tokens"  # the state holding a request's token sequence, i32[max_seq] (see step_end)
SCRATCH_PREFIX = "scratch."  # states a fused kernel uses within one launch (zero between launches), not model state
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}
Q4_GROUPS = (32, 64, 128)  # weight-only int4 with one f16 scale per group of this many inputs: dtype "q4g128"
ALIGN = 256  # every arena buffer starts on this boundary


def is_q4(dtype: str) -> bool:
    return dtype.startswith("q4g") and dtype[3:].isdigit() and int(dtype[3:]) in Q4_GROUPS


def q4_group(dtype: str) -> int:
    return int(dtype[3:])


class IRError(ValueError):
    """The program is malformed: wrong operand, shape, attribute or ordering."""


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self):
        if self.dtype not in DTYPES and not is_q4(self.dtype):
            raise IRError(f"unknown dtype {self.dtype!r} (known: {', '.join(DTYPES)}, q4g32/64/128)")
        if any((not isinstance(d, int)) or d <= 0 for d in self.shape):
            raise IRError(f"shape {self.shape} must be positive integers")
        if is_q4(self.dtype) and (len(self.shape) != 2 or self.shape[1] % q4_group(self.dtype)):
            raise IRError(f"{self}: a q4 weight is [out, in] with in a multiple of the group")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if is_q4(self.dtype):  # packed nibbles, then one f16 scale per group (see passes/quantize.py)
            n, k = self.shape
            return n * k // 2 + n * (k // q4_group(self.dtype)) * 2
        return self.numel * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


class Value:
    """An SSA temporary defined by exactly one op. Identity is the object; names come at print time.
    ``loc`` is its arena placement (region, byte offset) once plan_memory has run."""

    __slots__ = ("type", "loc")

    def __init__(self, type: TensorType, loc: tuple[str, int] | None = None):
        self.type = type
        self.loc = loc

    def __repr__(self) -> str:
        return f"Value({self.type})"


@dataclass(eq=False)
class Weight:
    """``source`` says how to make the bytes from the checkpoint, as a JSON-able recipe:
    ["ckpt", name] | ["reshape", [dims], r] | ["concat", axis, r1, r2, ...] | ["cast", dtype, r]
    | ["q4", group, r] (see compiler/weights.py)."""

    name: str
    type: TensorType
    source: list | None = None
    loc: tuple[str, int] | None = None


@dataclass(eq=False)
class State:
    name: str
    type: TensorType
    loc: tuple[str, int] | None = None


@dataclass(eq=False)
class Dyn:
    """A 4-byte per-token slot. ``host``: the host passes it with every launch (a kernel argument,
    which changes per token); otherwise it lives in the device dyn buffer (see hoist_dynamic)."""

    name: str
    dtype: str  # i32 or f32
    host: bool = False
    loc: tuple[str, int] | None = None


Operand = Value | Weight | State | Dyn


@dataclass(eq=False)
class Op:
    kind: str
    outs: list  # Values, or Dyn slots the op writes
    ins: list  # Operands
    attrs: dict = field(default_factory=dict)
    launch: dict | None = None  # set by select_kernels: kernel id and launch configuration


@dataclass
class Program:
    dyn: dict[str, Dyn] = field(default_factory=dict)
    weights: dict[str, Weight] = field(default_factory=dict)
    states: dict[str, State] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    outputs: dict[str, Value] = field(default_factory=dict)
    arena: dict[str, int] = field(default_factory=dict)  # region -> bytes, set by plan_memory
    target: str | None = None  # set by select_kernels

    # --- building ------------------------------------------------------------------------
    def add_dyn(self, name: str, dtype: str, host: bool = False) -> Dyn:
        if name in self.dyn:
            raise IRError(f"dyn slot {name!r} declared twice")
        self.dyn[name] = d = Dyn(name, dtype, host)
        return d

    def add_weight(self, name: str, dtype: str, shape, source: list | None = None) -> Weight:
        if name in self.weights or name in self.states:
            raise IRError(f"weight {name!r} declared twice")
        self.weights[name] = w = Weight(name, TensorType(dtype, tuple(shape)), source)
        return w

    def add_state(self, name: str, dtype: str, shape) -> State:
        if name in self.states or name in self.weights:
            raise IRError(f"state {name!r} declared twice")
        self.states[name] = s = State(name, TensorType(dtype, tuple(shape)))
        return s

    def emit(self, kind: str, *ins, out=None, **attrs):
        """Append an op; infer its result types. Returns the single Value, a tuple, or None."""
        spec = OP_SPECS.get(kind)
        if spec is None:
            raise IRError(f"unknown op {kind!r}")
        out_types = spec.infer(list(ins), attrs)
        if spec.writes_dyn:
            outs = list(out) if isinstance(out, (list, tuple)) else [out]
        else:
            outs = [Value(t) for t in out_types]
        self.ops.append(Op(kind, outs, list(ins), dict(attrs)))
        if spec.writes_dyn or not outs:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    def weight_bytes(self) -> int:
        return sum(w.type.nbytes for w in self.weights.values())

    def state_bytes(self) -> int:
        return sum(s.type.nbytes for s in self.states.values())


# --- op specifications -------------------------------------------------------------------

@dataclass(frozen=True)
class OpSpec:
    """operands: one letter per operand: v value, w weight, s state, d dyn slot, t tensor (v|w|s).
    inout: operand indices the op updates in place (states). writes_dyn: outputs are dyn slots."""

    operands: str
    attrs: tuple[str, ...]
    infer: Callable[[list, dict], list[TensorType]]
    inout: tuple[int, ...] = ()
    writes_dyn: bool = False
    doc: str = ""


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


def _infer_rmsnorm(ins, a):
    x, w = ins
    _need(_t(w).shape == (_t(x).shape[-1],), f"rmsnorm weight {_t(w).shape} vs last axis of {_t(x).shape}")
    return [_f32(_t(x).shape)]


def _infer_matmul(ins, a):
    x, w = ins
    xs, ws = _t(x).shape, _t(w).shape
    _need(len(xs) == 1 and len(ws) == 2 and ws[1] == xs[0], f"matmul [{xs}] x W{ws}: W must be [out, {xs}]")
    return [_f32((ws[0],))]


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
    logits, temp, top_p, seed, pos = ins
    _need(len(_t(logits).shape) == 1, "sample takes a [vocab] logits vector")
    return []


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


def _infer_gdn_step(ins, a):
    qkv, z, b, av, conv_state, conv_w, a_log, dt_bias, norm_w, rec = ins
    hv, _, dv = _t(rec).shape
    _need(_t(z).shape == (hv * dv,), f"z must be [{hv * dv}]")
    _need(_t(norm_w).shape == (dv,), f"the norm weight must be [{dv}]")
    return _infer_gdn_delta([qkv, b, av, conv_state, conv_w, a_log, dt_bias, rec], a)


def _infer_gdn_delta(ins, a):
    qkv, b, av, conv_state, conv_w, a_log, dt_bias, rec = ins
    hv, dk, dv = _t(rec).shape
    (c,) = _t(qkv).shape
    _need(_t(rec).dtype == "f32", "recurrent state must be f32")
    _need(_t(b).shape == (hv,) and _t(av).shape == (hv,), f"a and b must be [{hv}]")
    _need((c - hv * dv) > 0 and (c - hv * dv) % (2 * dk) == 0, f"qkv [{c}] does not split into q, k, v heads")
    hk = (c - hv * dv) // (2 * dk)
    _need(hv % hk == 0, f"value heads {hv} must be a multiple of key heads {hk}")
    kk = _t(conv_w).shape[1] if len(_t(conv_w).shape) == 2 else 0
    _need(_t(conv_w).shape == (c, kk) and _t(conv_state).shape == (c, kk - 1), "conv weight/state do not match qkv")
    _need(_t(a_log).shape == (hv,) and _t(dt_bias).shape == (hv,), "A_log, dt_bias must be [Hv]")
    return [_f32((hv * dv,))]


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


OP_SPECS: dict[str, OpSpec] = {
    "embedding": OpSpec("wd", (), _infer_embedding, doc="row `token` of the table"),
    "rmsnorm": OpSpec("tw", ("eps",), _infer_rmsnorm, doc="x * rsqrt(mean(x^2) + eps) * (1 + w), fp32, last axis"),
    "matmul": OpSpec("vw", (), _infer_matmul, doc="W @ x (W is [out, in])"),
    "add": OpSpec("vv", (), _infer_same, doc="a + b"),
    "reshape": OpSpec("v", ("shape",), _infer_reshape),
    "slice": OpSpec("v", ("axis", "start", "stop"), _infer_slice),
    "conv1d_step": OpSpec("vsw", ("act",), _infer_conv1d_step, inout=(1,),
                          doc="depthwise causal conv over [state | x], then act; state keeps the last K-1 inputs"),
    "l2norm": OpSpec("v", ("eps",), _infer_same, doc="x * rsqrt(sum(x^2) + eps), last axis"),
    "gdn_gates": OpSpec("vvww", (), _infer_gdn_gates,
                        doc="g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b)"),
    "gated_delta_step": OpSpec("vvvvvs", ("scale",), _infer_gated_delta, inout=(5,),
                               doc="S = S*exp(g); S += k (x) beta*(v - S^T k); o = S^T (q*scale)"),
    "gated_rmsnorm": OpSpec("vvw", ("eps",), _infer_gated_rmsnorm, doc="w * rmsnorm(x) * silu(z), per head"),
    "rope": OpSpec("vd", ("theta", "rotary_dim"), _infer_rope, doc="NeoX rotary on the first rotary_dim dims at pos"),
    "kv_append": OpSpec("ssvvd", (), _infer_kv_append, inout=(0, 1), doc="caches[pos] = k, v"),
    "attention": OpSpec("vssd", ("scale",), _infer_attention, doc="softmax(q K[0..pos]^T * scale) V, GQA"),
    "sigmoid_gate": OpSpec("vv", (), _infer_same, doc="x * sigmoid(gate)"),
    "swiglu": OpSpec("vv", (), _infer_same, doc="silu(gate) * up"),
    "sample": OpSpec("vdddd", (), _infer_sample, writes_dyn=True,
                     doc="argmax if temperature == 0, else seeded top-p sampling; writes dyn.sampled"),
    "step_end": OpSpec("ddds", (), _infer_step_end, inout=(3,), writes_dyn=True,
                       doc="tokens[pos+1] = sampled unless still inside the prompt; token = tokens[pos+1]; pos += 1"),
    # --- fused ops (made by passes/fuse.py) ---
    "add_rmsnorm": OpSpec("vvw", ("eps",), _infer_add_rmsnorm, doc="s = x + y; (s, rmsnorm(s, w))"),
    "matmul_swiglu": OpSpec("vww", (), _infer_matmul_swiglu, doc="silu(Wg @ x) * (Wu @ x)"),
    "gdn_step": OpSpec("vvvvswwwws", ("eps", "l2_eps", "scale"), _infer_gdn_step, inout=(4, 9),
                       doc="conv1d_step+silu, split q|k|v, l2norm q and k, gates, gated_delta_step, gated_rmsnorm"),
    "gdn_delta": OpSpec("vvvswwws", ("l2_eps", "scale"), _infer_gdn_delta, inout=(7,),
                        doc="conv1d+silu (state only read), split q|k|v, l2norm q and k, gates, gated_delta_step"),
    "gdn_norm": OpSpec("vvvws", ("eps",), _infer_gdn_norm, inout=(4,),
                       doc="gated_rmsnorm(o, z, w) per head; conv state shifted, qkv appended"),
    "attn_step": OpSpec("vvvwwssdss", ("eps", "theta", "rotary_dim", "scale"), _infer_attn_step,
                        inout=(5, 6, 8, 9), doc="split q|gate per head, q/k rmsnorm, rope, kv_append, attention "
                        "(split over the sequence: partials and tickets in scratch states), sigmoid gate"),
}

VIEW_OPS = ("reshape", "slice")


def is_view(op: Op) -> bool:
    """reshape, and slices of contiguous leading ranges, alias their input: no data moves."""
    if op.kind == "reshape":
        return True
    if op.kind == "slice":
        return all(d == 1 for d in op.ins[0].type.shape[:op.attrs["axis"]])
    return False

_OPERAND_CLASS = {"v": (Value,), "w": (Weight,), "s": (State,), "d": (Dyn,), "t": (Value, Weight, State)}
_KIND_NAME = {Value: "value", Weight: "weight", State: "state", Dyn: "dyn slot"}


def verify(program: Program) -> None:
    """Check every op against its spec; every value defined once, before use; outputs defined.

    Raises IRError naming the first offending op (by index and kind).
    """
    defined: set[int] = set()
    for i, op in enumerate(program.ops):
        where = f"op #{i} ({op.kind})"
        spec = OP_SPECS.get(op.kind)
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
        extra = [k for k in op.attrs if k not in spec.attrs]
        if missing or extra:
            raise IRError(f"{where}: attributes missing {missing} / unexpected {extra}")
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
    if program.arena:
        _verify_memory(program)


def _verify_memory(program: Program) -> None:
    """After plan_memory: everything placed inside its region, allocated buffers aligned, and no two
    activations that are live at the same time share a byte (views alias their base)."""
    for group in (program.weights.values(), program.states.values()):
        for x in group:
            region = x.loc[0] if x.loc else None
            if x.loc is None or x.loc[1] % ALIGN or x.loc[1] + x.type.nbytes > program.arena.get(region, -1):
                raise IRError(f"{x.name}: placement {x.loc} is missing, unaligned or outside its region")
    base: dict[int, Value] = {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        for x in op.ins:
            if isinstance(x, Value):
                last[id(base.get(id(x), x))] = i
        if is_view(op):
            base[id(op.outs[0])] = base.get(id(op.ins[0]), op.ins[0])
            continue
        for o in op.outs:
            if isinstance(o, Value):
                if o.loc is None or o.loc[0] != "act" or o.loc[1] % ALIGN or \
                        o.loc[1] + o.type.nbytes > program.arena["act"]:
                    raise IRError(f"op #{i} ({op.kind}): result placement {o.loc} is missing, unaligned or outside act")
                first[id(o)], last[id(o)] = i, max(last.get(id(o), i), i)
    for v in program.outputs.values():
        last[id(base.get(id(v), v))] = len(program.ops)
    bufs = sorted((first[k], last[k], k) for k in first)
    values = {id(o): o for op in program.ops for o in op.outs if isinstance(o, Value)}
    for i, (f1, l1, k1) in enumerate(bufs):
        a = values[k1]
        for f2, l2, k2 in bufs[i + 1:]:
            if f2 > l1:
                break
            b = values[k2]
            if a.loc[1] < b.loc[1] + b.type.nbytes and b.loc[1] < a.loc[1] + a.type.nbytes:
                raise IRError(f"activations live at ops {f1}..{l1} and {f2}..{l2} overlap in the arena "
                              f"({a.loc} and {b.loc})")
