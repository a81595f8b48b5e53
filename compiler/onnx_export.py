"""The step program as an ONNX graph, emitted from Kestrel's own IR with ``onnx.helper`` (no tracing).

This file holds the exporter (``export_program``: Program + weight bytes -> ModelProto), the command
behind ``kestrelc export-onnx`` (``export``) and the compiler half of ``kestrelc build --backend
tensorrt`` (``build_tensorrt``: ONNX next to the plan, then, where TensorRT and a GPU are present, an
engine stored in the .plan container; the TensorRT calls live in runtime/tensorrt.py).

Which program: the lowering followed by ``fuse`` and ``quantize`` (``step_program``), i.e. before
``hoist_dynamic``: dyn slots are still host values and there is no ``step_end``; the host (or the
engine runner) advances pos and feeds the next token. Every op kind that can appear there, fused or
not, is exported as the ONNX sequence that computes what its torch reference in kernels/*.py computes,
in fp32 and in the same order (zero-centred RMSNorm x * rsqrt(mean(x^2) + eps) * (1 + w); the gated
norm w * norm(x) * silu(z); partial NeoX RoPE with the reference's fp32 inverse frequencies; the
Gated DeltaNet conv window and delta rule; GQA attention), so onnxruntime reproduces the CPU
reference path (tests/test_onnx.py: same greedy tokens, logits within 1e-4).

Graph interface (every shape static; TensorRT builds it with fixed shapes):

    inputs   token int64[1], pos int64[1]
             <state>      for every state an op reads or writes, in its program dtype and shape:
                          layers.N.conv_state f32[C, K-1], layers.N.recurrent_state f32[Hv, Dk, Dv],
                          layers.N.k_cache / v_cache [max_seq, Hkv, D] (bf16 unless --quant none)
    outputs  logits f32[vocab], hidden f32[hidden] (the program's outputs),
             next_token int64[1] (greedy: argmax, the first index among equal maxima),
             <state>.out  the state after the step (same dtype and shape), in the inputs' order

Feeding each ``<state>.out`` back as ``<state>`` (ping-pong buffers) and ``next_token`` as ``token``
at ``pos + 1`` decodes. The KV caches hold all max_seq rows: k and v are written at row pos with
ScatterND, and attention scores every row, with rows after pos masked to -inf before the softmax
(the mask is built from pos), which equals the reference's softmax over rows 0..pos. States no op
touches and dyn slots no op reads are not part of the graph (e.g. the token sequence the runtime's
step_end uses), nor is the GPU kernels' attention scratch (``scratch.*``); the ``sample`` op's temperature, top_p and seed are ignored: the graph is greedy.

Precision (``--quant``): ``none``: FLOAT initializers. ``bf16``: matrices and the embedding table as
BFLOAT16 initializers, each followed by a Cast to float (the math stays fp32, as in Kestrel's
kernels), KV caches bf16. ``q4``: each q4 matrix is dequantized at export to the FLOAT values the
CPU reference multiplies by ((q - 8) * scale, exact in fp32), so a q4 ONNX is as large as an fp32
one; KV caches bf16. Weights whose ONNX bytes exceed 1 GiB (or on request) go to one external data
file next to the model, written one tensor at a time, so memory stays bounded.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from kestrel.artifacts.errors import BackendMissingError, DeviceError, InputError, UnsupportedError
from kestrel.compiler.ir import OP_SPECS, Dyn, Op, Program, State, Value, Weight, is_q4, q4_group

OPSET = 17  # ReduceMean takes axes as an attribute here; widely supported by TensorRT's ONNX parser
IR_VERSION = 8  # the ONNX IR version of opset 17 (onnx 1.12): readable by older consumers
EXTERNAL_THRESHOLD = 1 << 30  # weights above this many bytes go to an external data file
EXTERNAL_ALIGN = 4096
STATE_OUT_SUFFIX = ".out"


def _onnx():
    try:
        import onnx
    except ImportError:
        raise BackendMissingError("the onnx package is not installed: pip install 'kestrel[onnx]' "
                                  "(onnx==1.23.2)") from None
    return onnx


def _elem(dtype: str) -> int:
    from onnx import TensorProto as T

    return {"f32": T.FLOAT, "bf16": T.BFLOAT16, "f16": T.FLOAT16, "i32": T.INT32}[dtype]


def onnx_weight_dtype(w: Weight) -> str:
    """The dtype a weight has in the ONNX graph: q4 is dequantized to f32, the rest keep theirs."""
    return "f32" if is_q4(w.type.dtype) else w.type.dtype


def onnx_weight_bytes(w: Weight) -> int:
    return w.type.numel * (4 if onnx_weight_dtype(w) == "f32" else 2)


def onnx_weight_data(w: Weight, raw) -> bytes | memoryview:
    """``raw``: the weight's bytes as the plan stores them (compiler/weights.weight_bytes). Returns the
    little-endian bytes of the ONNX initializer: the same bytes, or for q4 the dequantized floats."""
    if is_q4(w.type.dtype):
        import torch

        from kestrel.kernels.matvec import q4_unpack

        buf = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())
        return memoryview(q4_unpack(buf, *w.type.shape, q4_group(w.type.dtype)).contiguous().numpy()).cast("B")
    return raw


@dataclass
class StepSignature:
    """The graph's interface, also recorded in the model's metadata (``kestrel.step``)."""

    inputs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (dtype, shape)
    outputs: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    states: list[tuple[str, str]] = field(default_factory=list)  # (input name, output name)

    def to_json(self) -> dict:
        return {"inputs": self.inputs, "outputs": self.outputs, "states": self.states}


class _Graph:
    """Accumulates nodes and initializers; every helper returns the name of the tensor it makes."""

    def __init__(self):
        from onnx import helper

        self.helper = helper
        self.nodes, self.initializers, self.consts = [], [], {}
        self.scope, self.count = "", 0

    def node(self, op_type: str, inputs: list[str], **attrs) -> str:
        """One node with one output, named after the IR op it belongs to (``op12.attn_step/MatMul_345``)."""
        self.count += 1
        name = f"{self.scope}/{op_type}_{self.count}"
        self.nodes.append(self.helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def const(self, array: np.ndarray) -> str:
        """A small constant initializer (shapes, indices, scalars), shared by value."""
        from onnx import numpy_helper

        array = np.ascontiguousarray(array)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self.consts:
            name = f"const.{len(self.consts)}"
            self.initializers.append(numpy_helper.from_array(array, name))
            self.consts[key] = name
        return self.consts[key]

    def f32(self, x: float) -> str:
        return self.const(np.array(x, dtype=np.float32))

    def i64(self, values) -> str:
        return self.const(np.array(values, dtype=np.int64))


class _Exporter:
    """Walks the program op by op, keeping the current ONNX tensor of every state (ops update states
    in place in the IR; here each update is a new tensor and later readers see it)."""

    def __init__(self, program: Program, weight_init):
        self.p = program
        self.g = _Graph()
        self.weight_init = weight_init  # Weight -> initializer name (made on first use)
        self.env: dict[int, str] = {}  # id(Value) -> tensor
        self.state: dict[str, str] = {}  # state name -> current tensor
        self.w32: dict[str, str] = {}  # weight name -> its fp32 tensor
        self.cache: dict[tuple, object] = {}  # per-step shared subgraphs (rope tables, mask, pos index)
        self.dyn_read: set[str] = set()
        self.next_token: str | None = None

    # --- operands ----------------------------------------------------------------------------
    def f32(self, x) -> str:
        """Any tensor operand as an fp32 tensor."""
        if isinstance(x, Value):
            return self.env[id(x)]
        if isinstance(x, Weight):
            if x.name not in self.w32:
                t = self.weight_init(x)
                self.w32[x.name] = t if onnx_weight_dtype(x) == "f32" else self.cast(t, "f32")
            return self.w32[x.name]
        if isinstance(x, State):
            t = self.read_state(x)
            return t if x.type.dtype == "f32" else self.cast(t, "f32")
        raise UnsupportedError(f"ONNX export: operand {x!r} is not a tensor")

    def read_state(self, s: State) -> str:
        return self.state.setdefault(s.name, s.name)

    def write_state(self, s: State, t: str) -> None:
        self.state[s.name] = t if s.type.dtype == "f32" else self.cast(t, s.type.dtype)

    def dyn(self, d: Dyn) -> str:
        if d.name not in ("token", "pos"):
            raise UnsupportedError(f"ONNX export: an op reads dyn slot {d.name!r}; the graph's per-token inputs are "
                                   f"token and pos only")
        self.dyn_read.add(d.name)
        return d.name

    def cast(self, t: str, dtype: str) -> str:
        return self.g.node("Cast", [t], to=_elem(dtype))

    # --- primitives: each mirrors one torch reference ------------------------------------------
    def reshape(self, x: str, shape) -> str:
        return self.g.node("Reshape", [x, self.g.i64(list(shape))])

    def slice(self, x: str, axis: int, start: int, stop: int) -> str:
        return self.g.node("Slice", [x, self.g.i64([start]), self.g.i64([stop]), self.g.i64([axis])])

    def unsqueeze(self, x: str, axes) -> str:
        return self.g.node("Unsqueeze", [x, self.g.i64(list(axes))])

    def reduce_sum(self, x: str, axis: int, keepdims: int) -> str:
        return self.g.node("ReduceSum", [x, self.g.i64([axis])], keepdims=keepdims)

    def silu(self, x: str) -> str:  # F.silu: x * sigmoid(x)
        return self.g.node("Mul", [x, self.g.node("Sigmoid", [x])])

    def rsqrt(self, x: str) -> str:
        return self.g.node("Reciprocal", [self.g.node("Sqrt", [x])])

    def norm(self, x: str, eps: float) -> str:  # x * rsqrt(mean(x^2, -1) + eps)
        g = self.g
        ms = g.node("ReduceMean", [g.node("Mul", [x, x])], axes=[-1], keepdims=1)
        return g.node("Mul", [x, self.rsqrt(g.node("Add", [ms, g.f32(eps)]))])

    def rmsnorm(self, x: str, w: str, eps: float) -> str:  # rmsnorm_ref: norm(x) * (1 + w)
        return self.g.node("Mul", [self.norm(x, eps), self.g.node("Add", [self.g.f32(1.0), w])])

    def gated_rmsnorm(self, x: str, z: str, w: str, eps: float) -> str:  # w * norm(x) * silu(z)
        return self.g.node("Mul", [self.g.node("Mul", [w, self.norm(x, eps)]), self.silu(z)])

    def l2norm(self, x: str, eps: float) -> str:  # x * rsqrt(sum(x^2, -1) + eps)
        g = self.g
        ss = self.reduce_sum(g.node("Mul", [x, x]), -1, 1)
        return g.node("Mul", [x, self.rsqrt(g.node("Add", [ss, g.f32(eps)]))])

    def matmul(self, x: str, w: Weight) -> str:  # matvec_ref: W [N, K] @ x [K], fp32
        return self.g.node("MatMul", [self.f32(w), x])

    def conv_window(self, x: str, conv_state: State) -> str:  # [state | x]: [C, K], oldest first
        return self.g.node("Concat", [self.f32(conv_state), self.unsqueeze(x, [1])], axis=1)

    def conv1d(self, window: str, w: Weight, act: str) -> str:  # conv1d_ref: sum(window * w, 1), then act
        out = self.reduce_sum(self.g.node("Mul", [window, self.f32(w)]), 1, 0)
        return self.silu(out) if act == "silu" else out

    def conv_shift(self, window: str, conv_state: State) -> None:  # conv_shift_ref: drop the oldest column
        self.write_state(conv_state, self.slice(window, 1, 1, conv_state.type.shape[1] + 1))

    def gates(self, a: str, b: str, a_log: Weight, dt_bias: Weight):  # gdn_gates_ref
        g = self.g
        decay = g.node("Neg", [g.node("Exp", [self.f32(a_log)])])
        return (g.node("Mul", [decay, g.node("Softplus", [g.node("Add", [a, self.f32(dt_bias)])])]),
                g.node("Sigmoid", [b]))

    def repeat_heads(self, x: str, heads: int, rep: int, dim: int) -> str:  # repeat_interleave(rep, dim=0)
        if rep == 1:
            return x
        e = self.g.node("Expand", [self.unsqueeze(x, [1]), self.g.i64([heads, rep, dim])])
        return self.reshape(e, [heads * rep, dim])

    def delta_rule(self, q: str, k: str, v: str, g_: str, beta: str, rec: State, hk: int, scale: float) -> str:
        """gated_delta_step_ref: S = S * exp(g); S += k (x) beta * (v - S^T k); o = S^T (q * scale);
        q, k [Hk, Dk] (value head j reads key head j // (Hv / Hk)), v [Hv, Dv], g, beta [Hv]."""
        g = self.g
        hv, dk, dv = rec.type.shape
        rep = hv // hk
        q = g.node("Mul", [self.repeat_heads(q, hk, rep, dk), g.f32(scale)])
        k = self.repeat_heads(k, hk, rep, dk)
        s = g.node("Mul", [self.read_state(rec), self.reshape(g.node("Exp", [g_]), [hv, 1, 1])])
        kv_mem = self.reshape(g.node("MatMul", [self.reshape(k, [hv, 1, dk]), s]), [hv, dv])
        delta = g.node("Mul", [g.node("Sub", [v, kv_mem]), self.reshape(beta, [hv, 1])])
        s = g.node("Add", [s, g.node("Mul", [self.reshape(k, [hv, dk, 1]), self.reshape(delta, [hv, 1, dv])])])
        self.write_state(rec, s)
        return self.reshape(g.node("MatMul", [self.reshape(q, [hv, 1, dk]), s]), [hv, dv])

    def rope_tables(self, pos: str, theta: float, rotary_dim: int):
        """cos, sin [rotary_dim] at pos: the reference's fp32 inverse frequencies (as constants) times pos."""
        key = ("rope", theta, rotary_dim)
        if key not in self.cache:
            from kestrel.kernels.attention import rope_inv_freq

            g = self.g
            inv = g.const(rope_inv_freq(theta, rotary_dim).numpy().astype(np.float32))
            freqs = g.node("Mul", [self.cast(pos, "f32"), inv])
            emb = g.node("Concat", [freqs, freqs], axis=0)
            self.cache[key] = (g.node("Cos", [emb]), g.node("Sin", [emb]))
        return self.cache[key]

    def rope(self, x: str, d: int, pos: str, theta: float, rotary_dim: int) -> str:  # rope_ref (NeoX halves)
        g = self.g
        cos, sin = self.rope_tables(pos, theta, rotary_dim)
        rot, half = self.slice(x, 1, 0, rotary_dim), rotary_dim // 2
        rotated = g.node("Concat", [g.node("Neg", [self.slice(rot, 1, half, rotary_dim)]), self.slice(rot, 1, 0, half)],
                         axis=1)
        out = g.node("Add", [g.node("Mul", [rot, cos]), g.node("Mul", [rotated, sin])])
        if rotary_dim < d:
            out = g.node("Concat", [out, self.slice(x, 1, rotary_dim, d)], axis=1)
        return out

    def pos_index(self, pos: str) -> str:
        if "pos_index" not in self.cache:
            self.cache["pos_index"] = self.reshape(pos, [1, 1])
        return self.cache["pos_index"]

    def kv_append(self, kc: State, vc: State, k: str, v: str, pos: str) -> None:  # kv_append_ref at row pos
        idx = self.pos_index(pos)
        for cache, x in ((kc, k), (vc, v)):
            row = self.unsqueeze(x if cache.type.dtype == "f32" else self.cast(x, cache.type.dtype), [0])
            self.state[cache.name] = self.g.node("ScatterND", [self.read_state(cache), idx, row])

    def attention(self, q: str, h: int, kc: State, vc: State, pos: str, scale: float) -> str:
        """attention_ref over rows 0..pos (q [H, D]): every row scored, rows after pos masked to -inf;
        query head h reads kv head h // (H / Hkv), so q is viewed as [Hkv, H / Hkv, D]."""
        g = self.g
        s, hkv, d = kc.type.shape
        rep = h // hkv
        if ("mask", s) not in self.cache:
            self.cache[("mask", s)] = g.node("LessOrEqual", [g.i64(np.arange(s)), pos])  # [S] bool
        kt = g.node("Transpose", [self.f32(kc)], perm=[1, 2, 0])  # [Hkv, D, S]
        scores = g.node("Mul", [g.node("MatMul", [self.reshape(q, [hkv, rep, d]), kt]), g.f32(scale)])
        scores = g.node("Where", [self.cache[("mask", s)], scores, g.f32(-math.inf)])
        p = g.node("Softmax", [scores], axis=-1)
        vt = g.node("Transpose", [self.f32(vc)], perm=[1, 0, 2])  # [Hkv, S, D]
        return self.reshape(g.node("MatMul", [p, vt]), [h, d])

    # --- ops ---------------------------------------------------------------------------------
    def export_op(self, i: int, op: Op) -> None:
        self.g.scope = f"op{i}.{op.kind}"
        fn = getattr(self, "op_" + op.kind, None)
        if fn is None:
            raise UnsupportedError(f"ONNX export: op #{i} ({op.kind}) has no ONNX form; export the program before "
                                   f"hoist_dynamic (lower + fuse + quantize)")
        res = fn(op, *op.ins)
        if OP_SPECS[op.kind].writes_dyn or res is None:
            return
        for v, t in zip(op.outs, res if isinstance(res, tuple) else (res,)):
            self.env[id(v)] = t

    def op_embedding(self, op, table: Weight, tok: Dyn):  # embedding_ref: row token, as fp32
        t = self.weight_init(table)
        row = self.reshape(self.g.node("Gather", [t, self.dyn(tok)], axis=0), [table.type.shape[1]])
        return row if onnx_weight_dtype(table) == "f32" else self.cast(row, "f32")

    def op_rmsnorm(self, op, x, w):
        return self.rmsnorm(self.f32(x), self.f32(w), op.attrs["eps"])

    def op_matmul(self, op, x, w):
        return self.matmul(self.f32(x), w)

    def op_add(self, op, a, b):
        return self.g.node("Add", [self.f32(a), self.f32(b)])

    def op_reshape(self, op, x):
        return self.reshape(self.f32(x), op.attrs["shape"])

    def op_slice(self, op, x):
        return self.slice(self.f32(x), op.attrs["axis"], op.attrs["start"], op.attrs["stop"])

    def op_conv1d_step(self, op, x, st, w):  # conv1d_step_ref: output, then the shift
        window = self.conv_window(self.f32(x), st)
        out = self.conv1d(window, w, op.attrs["act"])
        self.conv_shift(window, st)
        return out

    def op_l2norm(self, op, x):
        return self.l2norm(self.f32(x), op.attrs["eps"])

    def op_gdn_gates(self, op, a, b, a_log, dt_bias):
        return self.gates(self.f32(a), self.f32(b), a_log, dt_bias)

    def op_gated_delta_step(self, op, q, k, v, g_, beta, st):
        return self.delta_rule(self.f32(q), self.f32(k), self.f32(v), self.f32(g_), self.f32(beta), st,
                               q.type.shape[0], op.attrs["scale"])

    def op_gated_rmsnorm(self, op, x, z, w):
        return self.gated_rmsnorm(self.f32(x), self.f32(z), self.f32(w), op.attrs["eps"])

    def op_rope(self, op, x, pos):
        return self.rope(self.f32(x), x.type.shape[1], self.dyn(pos), op.attrs["theta"], op.attrs["rotary_dim"])

    def op_kv_append(self, op, kc, vc, k, v, pos):
        self.kv_append(kc, vc, self.f32(k), self.f32(v), self.dyn(pos))

    def op_attention(self, op, q, kc, vc, pos):
        return self.attention(self.f32(q), q.type.shape[0], kc, vc, self.dyn(pos), op.attrs["scale"])

    def op_sigmoid_gate(self, op, x, gate):
        return self.g.node("Mul", [self.f32(x), self.g.node("Sigmoid", [self.f32(gate)])])

    def op_swiglu(self, op, gate, up):
        return self.g.node("Mul", [self.silu(self.f32(gate)), self.f32(up)])

    def op_sample(self, op, logits, *ignored):  # greedy: sample_ref at temperature 0
        self.next_token = self.g.node("ArgMax", [self.f32(logits)], axis=0, keepdims=1, select_last_index=0)

    def op_add_rmsnorm(self, op, x, y, w):
        s = self.g.node("Add", [self.f32(x), self.f32(y)])
        return s, self.rmsnorm(s, self.f32(w), op.attrs["eps"])

    def op_matmul_swiglu(self, op, x, wg, wu):
        x = self.f32(x)
        return self.g.node("Mul", [self.silu(self.matmul(x, wg)), self.matmul(x, wu)])

    def _gdn_core(self, c: int, b: str, a: str, mixed: str, a_log, dt_bias, rec: State, l2_eps: float,
                  scale: float) -> str:
        """The middle of gdn_step_ref / gdn_delta_ref: split q|k|v, L2 norms, gates, delta rule."""
        hv, dk, dv = rec.type.shape
        hk = (c - hv * dv) // (2 * dk)
        q = self.l2norm(self.reshape(self.slice(mixed, 0, 0, hk * dk), [hk, dk]), l2_eps)
        k = self.l2norm(self.reshape(self.slice(mixed, 0, hk * dk, 2 * hk * dk), [hk, dk]), l2_eps)
        v = self.reshape(self.slice(mixed, 0, 2 * hk * dk, c), [hv, dv])
        g_, beta = self.gates(a, b, a_log, dt_bias)
        return self.delta_rule(q, k, v, g_, beta, rec, hk, scale)

    def op_gdn_delta(self, op, qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec):
        hv, _, dv = rec.type.shape
        mixed = self.conv1d(self.conv_window(self.f32(qkv), conv_state), conv_w, "silu")  # state only read
        o = self._gdn_core(qkv.type.shape[0], self.f32(b), self.f32(a), mixed, a_log, dt_bias, rec,
                           op.attrs["l2_eps"], op.attrs["scale"])
        return self.reshape(o, [hv * dv])

    def op_gdn_norm(self, op, o_raw, z, qkv, norm_w, conv_state):
        (dv,), (n,) = norm_w.type.shape, o_raw.type.shape
        out = self.gated_rmsnorm(self.reshape(self.f32(o_raw), [n // dv, dv]), self.reshape(self.f32(z), [n // dv, dv]),
                                 self.f32(norm_w), op.attrs["eps"])
        self.conv_shift(self.conv_window(self.f32(qkv), conv_state), conv_state)
        return self.reshape(out, [n])

    def op_gdn_step(self, op, qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec):
        hv, _, dv = rec.type.shape
        window = self.conv_window(self.f32(qkv), conv_state)
        mixed = self.conv1d(window, conv_w, "silu")
        self.conv_shift(window, conv_state)
        o = self._gdn_core(qkv.type.shape[0], self.f32(b), self.f32(a), mixed, a_log, dt_bias, rec,
                           op.attrs["l2_eps"], op.attrs["scale"])
        out = self.gated_rmsnorm(o, self.reshape(self.f32(z), [hv, dv]), self.f32(norm_w), op.attrs["eps"])
        return self.reshape(out, [hv * dv])

    def op_attn_step(self, op, qg, k, v, qn, kn, kc, vc, pos, *scratch):  # attn_step_ref (the split: a GPU detail)
        _, hkv, d = kc.type.shape
        nh = qg.type.shape[0] // (2 * d)
        a, p = op.attrs, self.dyn(pos)
        qg2 = self.reshape(self.f32(qg), [nh, 2 * d])
        q = self.rope(self.rmsnorm(self.slice(qg2, 1, 0, d), self.f32(qn), a["eps"]), d, p, a["theta"],
                      a["rotary_dim"])
        kr = self.rope(self.rmsnorm(self.reshape(self.f32(k), [hkv, d]), self.f32(kn), a["eps"]), d, p, a["theta"],
                       a["rotary_dim"])
        self.kv_append(kc, vc, kr, self.reshape(self.f32(v), [hkv, d]), p)
        o = self.reshape(self.attention(q, nh, kc, vc, p, a["scale"]), [nh * d])
        gate = self.reshape(self.slice(qg2, 1, d, 2 * d), [nh * d])
        return self.g.node("Mul", [o, self.g.node("Sigmoid", [gate])])


# --- the model ------------------------------------------------------------------------------------

class _ExternalData:
    """One external data file, tensors appended as they are produced (4 KiB aligned)."""

    def __init__(self, path: str, location: str):
        self.path, self.location, self.offset = path, location, 0
        self.f = open(path, "wb")

    def write(self, data) -> tuple[int, int]:
        pad = -self.offset % EXTERNAL_ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        n = memoryview(data).nbytes
        self.f.write(data)
        start, self.offset = self.offset, self.offset + n
        return start, n

    def close(self):
        self.f.close()


def export_program(program: Program, produce, *, external: _ExternalData | None = None,
                   metadata: dict | None = None):
    """Program -> (onnx.ModelProto, StepSignature).

    ``produce(name)`` returns a weight's bytes as the plan stores them (compiler/weights.weight_bytes);
    it is called once per weight an op uses, one at a time. With ``external``, initializer bytes are
    appended to that file as they are produced (bounded memory) and the model only refers to them.
    """
    _onnx()
    from onnx import TensorProto, helper

    initializers: list = []
    made: dict[str, str] = {}

    def weight_init(w: Weight) -> str:
        if w.name not in made:
            data = onnx_weight_data(w, produce(w.name))
            t = TensorProto(name=w.name, data_type=_elem(onnx_weight_dtype(w)), dims=list(w.type.shape))
            if external is not None:
                offset, length = external.write(data)
                for key, value in (("location", external.location), ("offset", offset), ("length", length)):
                    t.external_data.add(key=key, value=str(value))
                t.data_location = TensorProto.EXTERNAL
            else:
                t.raw_data = bytes(data)
            initializers.append(t)
            made[w.name] = w.name
        return made[w.name]

    ex = _Exporter(program, weight_init)
    for i, op in enumerate(program.ops):
        ex.export_op(i, op)
    g = ex.g
    g.scope = "outputs"
    sig = StepSignature()
    inputs, outputs = [], []
    for name in ("token", "pos"):
        if name in ex.dyn_read:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, [1]))
            sig.inputs[name] = ("i64", [1])

    def output(name: str, tensor: str, elem: int, shape, dtype: str):
        g.nodes.append(helper.make_node("Identity", [tensor], [name], name=f"outputs/{name}"))
        outputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        sig.outputs[name] = (dtype, list(shape))

    for name, v in program.outputs.items():
        output(name, ex.env[id(v)], TensorProto.FLOAT, v.type.shape, "f32")
    if ex.next_token is not None:
        output("next_token", ex.next_token, TensorProto.INT64, [1], "i64")
    for s in program.states.values():
        if s.name not in ex.state:
            continue  # no op reads or writes it (e.g. the runtime's token sequence)
        inputs.append(helper.make_tensor_value_info(s.name, _elem(s.type.dtype), list(s.type.shape)))
        sig.inputs[s.name] = (s.type.dtype, list(s.type.shape))
        output(s.name + STATE_OUT_SUFFIX, ex.state[s.name], _elem(s.type.dtype), s.type.shape, s.type.dtype)
        sig.states.append((s.name, s.name + STATE_OUT_SUFFIX))
    names = [x.name for x in inputs + outputs]
    clash = {n for n in names if names.count(n) > 1} | (set(names) & set(made))
    if clash:
        raise UnsupportedError(f"ONNX export: graph input/output names collide: {sorted(clash)[:3]}")
    graph = helper.make_graph(g.nodes, "kestrel_step", inputs, outputs, initializer=initializers + g.initializers,
                              doc_string="One Kestrel decode step (see compiler/onnx_export.py): feed <state>.out "
                                         "back as <state>, next_token as token at pos + 1.")
    from kestrel.artifacts.plan import producer_version

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="kestrel", producer_version=producer_version(),
                              doc_string="Kestrel step IR exported to ONNX")
    meta = {"kestrel.step": json.dumps(sig.to_json(), sort_keys=True)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()})
    helper.set_model_props(model, meta)
    return model, sig


def step_program(cfg, max_seq: int, quant: str = "none", q4_group: int | None = None, on_pass=None) -> Program:
    """The program the ONNX graph is made from: lower, then fuse and quantize (before hoist_dynamic)."""
    from kestrel.compiler.ir import verify
    from kestrel.compiler.pipeline import run_passes
    from kestrel.compiler.qwen3_5 import lower
    from kestrel.passes.quantize import DEFAULT_Q4_GROUP

    program = lower(cfg, max_seq)
    verify(program)
    if on_pass is not None:
        on_pass("lower", program)
    return run_passes(program, "cpu", quant, q4_group or DEFAULT_Q4_GROUP, until="quantize", on_pass=on_pass)


@contextlib.contextmanager
def open_model(model: str):
    """A checkpoint folder or a preset (synthesized into a temporary folder) as an open Checkpoint.
    Yields (checkpoint, source, tokenizer_json or None)."""
    from kestrel.compiler.frontend import open_checkpoint
    from kestrel.compiler.presets import PRESETS, QWEN35_SHAPES, byte_level_tokenizer_json, synthesize

    if model in QWEN35_SHAPES:
        raise InputError(f"preset {model} has shapes but no weights: ONNX export needs weights; give a checkpoint "
                         f"folder")
    with contextlib.ExitStack() as stack:
        if model in PRESETS:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kestrel-{model}-"))
            ck, source = open_checkpoint(synthesize(model, tmp)), {"kind": "preset", "name": model}
        else:
            ck, source = open_checkpoint(model), {"kind": "checkpoint", "path": os.path.abspath(model)}
        stack.callback(ck.close)
        tok_path = os.path.join(ck.folder, "tokenizer.json") if ck.folder else None
        tokenizer_json = None
        if tok_path and os.path.exists(tok_path):
            with open(tok_path, encoding="utf-8") as f:
                tokenizer_json = f.read()
        elif source["kind"] == "preset":
            tokenizer_json = byte_level_tokenizer_json()
        yield ck, source, tokenizer_json


@dataclass
class ExportResult:
    path: str
    data_path: str | None  # the external data file, if any
    nbytes: int  # model file + external data
    n_nodes: int
    signature: StepSignature
    program_text: str
    cfg: object
    source: dict
    tokenizer_json: str | None
    max_seq: int
    quant: str


def _resolve_max_seq(cfg, max_seq: int | None) -> int:
    from kestrel.compiler.pipeline import DEFAULT_MAX_SEQ

    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, cfg.max_position_embeddings)
    if not 1 <= max_seq <= cfg.max_position_embeddings:
        raise InputError(f"--max-seq {max_seq}: must be between 1 and the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    return max_seq


def export(model: str, out: str, quant: str = "none", q4_group: int | None = None, max_seq: int | None = None,
           external: bool | None = None, log=print, dump_ir_after: str | None = None, dump=print,
           check: bool = True) -> ExportResult:
    """``kestrelc export-onnx``: checkpoint or preset -> step.onnx (+ step.onnx.data for large models).

    ``external``: None decides by size (weights above 1 GiB go to ``OUT.data``), True / False force it.
    Options and the checkpoint are validated before anything is written; files appear under their
    names only when complete. With ``check``, the written model passes onnx.checker (full check)."""
    from kestrel.compiler.ir_text import print_program
    from kestrel.compiler.pipeline import PASS_NAMES
    from kestrel.compiler.weights import weight_bytes
    from kestrel.passes.quantize import QUANT_MODES

    if quant not in QUANT_MODES:
        raise UnsupportedError(f"--quant {quant}: unknown precision; choose one of {', '.join(QUANT_MODES)}")
    if dump_ir_after not in (None, "all", "lower") + PASS_NAMES[:2]:
        raise InputError(f"--dump-ir-after {dump_ir_after}: the ONNX step is made after quantize: choose lower, "
                         f"fuse, quantize or all")
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise InputError(f"-o {out}: folder {out_dir} does not exist")
    onnx = _onnx()

    def on_pass(name, prog):
        if dump_ir_after in (name, "all"):
            dump(f"# IR after {name}\n" + print_program(prog))

    with open_model(model) as (ck, source, tokenizer_json):
        cfg = ck.cfg
        max_seq = _resolve_max_seq(cfg, max_seq)
        for notice in ck.notices:
            log(f"note: {notice}")
        program = step_program(cfg, max_seq, quant, q4_group, on_pass=on_pass)
        total = sum(onnx_weight_bytes(w) for w in program.weights.values())
        if external is None:
            external = total > EXTERNAL_THRESHOLD
        data_path = out + ".data" if external else None
        tmp = out + ".tmp"
        sink = _ExternalData(data_path + ".tmp", os.path.basename(data_path)) if external else None
        try:
            model_proto, sig = export_program(
                program, lambda name: weight_bytes(program.weights[name], ck.read), external=sink,
                metadata={"kestrel.quant": quant, "kestrel.max_seq": max_seq, "kestrel.source": source,
                          "kestrel.model": cfg.to_json()})
            if sink is not None:
                sink.close()
            with open(tmp, "wb") as f:
                f.write(model_proto.SerializeToString())
            if sink is not None:
                os.replace(sink.path, data_path)
            os.replace(tmp, out)
        except BaseException:
            for p in (tmp, sink.path if sink else None):
                if p and os.path.exists(p):
                    os.remove(p)
            if sink is not None:
                sink.f.close()
            raise
    if check:
        onnx.checker.check_model(out, full_check=True)
    nbytes = os.path.getsize(out) + (os.path.getsize(data_path) if data_path else 0)
    n_nodes = len(model_proto.graph.node)
    log(f"kestrelc: wrote {out}{' + ' + os.path.basename(data_path) if data_path else ''}: {nbytes / 1e6:.1f} MB "
        f"({n_nodes} ONNX nodes, opset {OPSET}, quant {quant}, max_seq {max_seq}; inputs "
        f"{', '.join(list(sig.inputs)[:2])} + {len(sig.states)} states){'; onnx.checker: ok' if check else ''}")
    return ExportResult(out, data_path, nbytes, n_nodes, sig, print_program(program), cfg, source, tokenizer_json,
                        max_seq, quant)


# --- kestrelc build --backend tensorrt ------------------------------------------------------------

def onnx_path_for(plan_path: str) -> str:
    """Where ``build --backend tensorrt`` writes the ONNX step: next to the plan, as NAME.onnx."""
    return os.path.splitext(plan_path)[0] + ".onnx"


def build_tensorrt(model: str, out: str, target: str, quant: str | None = None, q4_group: int | None = None,
                   max_seq: int | None = None, log=print, dump_ir_after: str | None = None, dump=print,
                   weights: str = "checkpoint"):
    """The ONNX step next to the plan (OUT.onnx); then, where TensorRT and the target GPU are present, a
    TensorRT engine built from it (fixed shapes, strongly typed: the precision is the graph's) and
    stored in the .plan container with its TensorRT version and compute capability. Without TensorRT
    it stops after the ONNX with BackendMissingError (exit 9); without a matching GPU, DeviceError."""
    from kestrel.artifacts.plan import PlanInfo, write_plan
    from kestrel.compiler.pipeline import _check_options, default_quant
    from kestrel.kernels.targets import TARGETS

    quant = quant or default_quant(target)
    _check_options(target, quant, None)
    if target == "cpu":
        raise UnsupportedError("--backend tensorrt: a TensorRT engine runs on a GPU: give --target sm_XX (the GPU "
                               "that builds and runs the engine)")
    if weights != "checkpoint":
        raise UnsupportedError("--backend tensorrt: --weights random is for the kernels backend (the engine "
                               "holds its weights)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise InputError(f"-o {out}: folder {os.path.dirname(os.path.abspath(out))} does not exist")
    onnx_path = onnx_path_for(out)
    if os.path.abspath(onnx_path) == os.path.abspath(out):
        raise InputError(f"-o {out}: the plan needs its own name (the ONNX step is written to NAME.onnx next to it)")
    res = export(model, onnx_path, quant, q4_group, max_seq, log=log, dump_ir_after=dump_ir_after, dump=dump)
    wrote = f"wrote the ONNX step to {onnx_path}"

    from kestrel.runtime import tensorrt as rt

    try:
        rt.import_tensorrt()
    except BackendMissingError as e:
        raise BackendMissingError(f"--backend tensorrt: {e.message}; {wrote}: build the engine where TensorRT >= 10 "
                                  f"and an {target} GPU are present") from None
    cc = rt.gpu_compute_capability(f"--backend tensorrt: TensorRT builds the engine on the GPU that runs it; {wrote}")
    if cc != TARGETS[target].cc:
        raise DeviceError(f"--backend tensorrt --target {target}: this GPU is sm_{cc} and TensorRT builds for the GPU "
                          f"it runs on: use --target sm_{cc} or build on an {target} GPU; {wrote}")
    engine, version = rt.build_engine(onnx_path, log=log)
    extra = {"backend": "tensorrt", "tensorrt_version": version, "compute_capability": f"{cc // 10}.{cc % 10}",
             "tensorrt": {"engine_part": rt.ENGINE_PART, "onnx": os.path.basename(onnx_path),
                          "signature": res.signature.to_json(), "network": "strongly typed, fixed shapes"}}
    info = PlanInfo(target=target, quant=quant, max_seq=res.max_seq, model=res.cfg.to_json(), source=res.source,
                    tokenizer={"eos_token_ids": list(res.cfg.eos_token_ids)} if res.tokenizer_json else {},
                    extra=extra)
    write_plan(out, info, res.program_text, [], None, res.tokenizer_json, extra_parts={rt.ENGINE_PART: engine})
    log(f"kestrelc: wrote {out}: {os.path.getsize(out) / 1e6:.1f} MB (TensorRT {version} engine for sm_{cc}, "
        f"{len(engine) / 1e6:.1f} MB)")
    return out
