"""The step program as an ONNX graph, emitted from Kestrel's own IR with ``onnx.helper`` (no tracing).

This file is the emitter: ``export_program`` (Program + weight bytes -> ModelProto), ``write_onnx``
(the same, written to files). Each op kind's lowering is its record's ``onnx`` in compiler/ops.py,
built from the primitives of ``_Exporter`` here; ``kestrelc export-onnx`` and ``build --backend
tensorrt`` are compiler/build.py's.

Which program: the lowering followed by ``fuse`` and ``quantize`` (build.step_program), i.e. before
``hoist_dynamic``: dyn slots are still host values and there is no ``step_end``; the host (or the
engine runner) advances pos and feeds the next token. Every op kind that can appear there, fused or
not, is exported as the ONNX sequence that computes what its torch reference in kernels/*.py computes,
in fp32 and in the same order (zero-centred RMSNorm x * rsqrt(mean(x^2) + eps) * (1 + w); the gated
norm w * norm(x) * silu(z); partial NeoX RoPE with the reference's fp32 inverse frequencies; the
Gated DeltaNet conv window and delta rule; GQA attention; Qwen3-Next's routing (Softmax, TopK: equal values
lower index first, as the reference) and its experts' rows gathered from the stacked matrices by the TopK ids),
so onnxruntime reproduces the CPU reference path (tests/test_onnx.py: same greedy tokens, logits within 1e-4).

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
kernels), KV caches bf16. ``q4``: each q4 matrix stays 4-bit: its codes q - 8 as an INT4 initializer
``NAME`` [N, K] and its group scales as FLOAT ``NAME.scale`` [N, K / G], made fp32 by a blocked
DequantizeLinear (axis 1, block_size G): (q - 8) * scale, exact in fp32, the values the CPU reference
multiplies by. ONNX's Gather takes no INT4, so the stacked expert matrices of Qwen3-Next, whose routed
rows are gathered before they are dequantised, keep their codes q as UINT8 nibble pairs ``NAME`` [N, K / 2]
(input 2j in the low nibble, 2j + 1 in the high one: the INT4 bytes' order), unpacked after the Gather by
integer Div / Mul / Sub, then (q - 8) * scale in fp32: the same values. INT4 and block_size need opset 21 (IR
version 10), so a q4 graph is opset 21 and the others opset 17; a q4 file is ~0.53 bytes a weight where the
fp32 values took 4. KV caches bf16.
Weights whose ONNX bytes exceed 1 GiB (or on request) go to one external data file next to the model,
written one tensor at a time, so memory stays bounded.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel.artifacts.errors import OutputError, UnsupportedError, import_optional
from kestrel.artifacts.plan import STATE_OUT_SUFFIX, producer_version
from kestrel.compiler.ir import Dyn, Op, Program, State, Value, Weight, is_q4, q4_group
from kestrel.compiler.ops import OPS, NotApplicable
from kestrel.kernels.attention import rope_inv_freq
from kestrel.kernels.matvec import q4_codes

OPSET = 17  # ReduceMean takes axes as an attribute here; widely supported by TensorRT's ONNX parser
IR_VERSION = 8  # the ONNX IR version of opset 17 (onnx 1.12): readable by older consumers
OPSET_Q4 = 21  # INT4 tensors and DequantizeLinear's block_size (onnx 1.16); reductions take axes as inputs
IR_VERSION_Q4 = 10
EXTERNAL_THRESHOLD = 1 << 30  # weights above this many bytes go to an external data file
EXTERNAL_ALIGN = 4096


ONNX_MISSING = "the onnx package is not installed: pip install 'kestrel[onnx]' (onnx==1.23.2)"


def import_onnx():
    return import_optional("onnx", ONNX_MISSING)


def _elem(dtype: str) -> int:
    from onnx import TensorProto as T

    return {"f32": T.FLOAT, "bf16": T.BFLOAT16, "f16": T.FLOAT16, "i32": T.INT32, "int4": T.INT4,
            "u8": T.UINT8}[dtype]


def onnx_opset(program: Program) -> tuple[int, int]:
    """(opset, IR version) of the program's graph: 21 / 10 where a weight is q4 (INT4), else 17 / 8."""
    if any(is_q4(w.type.dtype) for w in program.weights.values()):
        return OPSET_Q4, IR_VERSION_Q4
    return OPSET, IR_VERSION


def onnx_weight_bytes(w: Weight) -> int:
    """A weight's bytes in the ONNX file (q4: 4-bit codes and fp32 scales)."""
    if is_q4(w.type.dtype):
        return w.type.numel // 2 + w.type.numel // q4_group(w.type.dtype) * 4
    return w.type.numel * (4 if w.type.dtype == "f32" else 2)


def q4_onnx_data(w: Weight, raw, form: str) -> tuple[bytes, bytes]:
    """``raw``: a q4 weight's bytes as the plan stores them (compiler/weights.weight_bytes). Returns the
    little-endian bytes of its ONNX codes, two a byte, input 2j in the low nibble (ONNX's INT4 order): ``int4``
    q - 8 (two's complement nibbles), ``nibbles`` q itself (UINT8 pairs, for the expert stacks); and of its
    FLOAT scales [N, K / G]."""
    codes, scales = q4_codes(torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()), *w.type.shape,
                             q4_group(w.type.dtype))  # (banded: a byte a weight at most)
    flat = codes.reshape(-1).numpy().astype(np.uint8) + np.uint8(0 if form == "int4" else 8)
    return ((flat[0::2] & 15) | ((flat[1::2] & 15) << 4)).tobytes(), scales.numpy().tobytes()


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

    def node_outs(self, op_type: str, inputs: list[str], n: int, **attrs) -> list[str]:
        """One node with n outputs (TopK's values and indices)."""
        self.count += 1
        name = f"{self.scope}/{op_type}_{self.count}"
        outs = [f"{name}.{i}" for i in range(n)]
        self.nodes.append(self.helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs

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

    def __init__(self, program: Program, weight_init, q4_init=None, opset: int = OPSET):
        self.p = program
        self.g = _Graph()
        self.weight_init = weight_init  # Weight (not q4) -> initializer name (made on first use)
        self.q4_init = q4_init  # (q4 Weight, form) -> (codes, scales) initializer names (made on first use)
        self.opset = opset
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
                if is_q4(x.type.dtype):
                    codes, scales = self.q4_init(x, "int4")
                    self.w32[x.name] = self.dequantize(codes, scales, 1, q4_group(x.type.dtype))
                else:
                    t = self.weight_init(x)
                    self.w32[x.name] = t if x.type.dtype == "f32" else self.cast(t, "f32")
            return self.w32[x.name]
        if isinstance(x, State):
            t = self.read_state(x)
            return t if x.type.dtype == "f32" else self.cast(t, "f32")
        raise UnsupportedError(f"ONNX export: operand {x!r} is not a tensor")

    def value(self, v: Value) -> str:
        """A value's tensor in its own dtype (the routing ids stay i32)."""
        return self.env[id(v)]

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

    def dequantize(self, codes: str, scales: str, axis: int, group: int) -> str:
        """(codes) * scales, each scale over ``group`` codes along axis: fp32, as the scales."""
        return self.g.node("DequantizeLinear", [codes, scales], axis=axis, block_size=group)

    # --- primitives: each mirrors one torch reference ------------------------------------------
    def reshape(self, x: str, shape) -> str:
        return self.g.node("Reshape", [x, self.g.i64(list(shape))])

    def slice(self, x: str, axis: int, start: int, stop: int) -> str:
        return self.g.node("Slice", [x, self.g.i64([start]), self.g.i64([stop]), self.g.i64([axis])])

    def unsqueeze(self, x: str, axes) -> str:
        return self.g.node("Unsqueeze", [x, self.g.i64(list(axes))])

    def reduce_sum(self, x: str, axis: int, keepdims: int) -> str:
        return self.g.node("ReduceSum", [x, self.g.i64([axis])], keepdims=keepdims)

    def reduce(self, op_type: str, x: str, axis: int, keepdims: int) -> str:
        """ReduceMean / ReduceSumSquare: axes an attribute up to opset 17, an input from 18."""
        if self.opset >= 18:
            return self.g.node(op_type, [x, self.g.i64([axis])], keepdims=keepdims)
        return self.g.node(op_type, [x], axes=[axis], keepdims=keepdims)

    def silu(self, x: str) -> str:  # F.silu: x * sigmoid(x)
        return self.g.node("Mul", [x, self.g.node("Sigmoid", [x])])

    def rsqrt(self, x: str) -> str:
        return self.g.node("Reciprocal", [self.g.node("Sqrt", [x])])

    def norm(self, x: str, eps: float) -> str:  # x * rsqrt(mean(x^2, -1) + eps)
        g = self.g
        ms = self.reduce("ReduceMean", g.node("Mul", [x, x]), -1, 1)
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

    def expert_rows(self, w: Weight, ids: Value, experts: int) -> str:
        """The routed experts' blocks of a stacked matrix w [E * R, C] (expert e: rows e R .. e R + R - 1):
        [k, R, C] fp32 for ids [k]; gathered before the cast (bf16) or the dequantisation (q4: the UINT8 nibble
        pairs and their scales gathered alike, the nibbles split by integer arithmetic, q - 8 times each group's
        scale), so a stack is never made fp32 whole."""
        (rows, cols), (k,) = w.type.shape, ids.type.shape
        r = rows // experts
        if is_q4(w.type.dtype):
            g, group = self.g, q4_group(w.type.dtype)
            packed, scales = self.q4_init(w, "nibbles")
            pairs, sc = (g.node("Gather", [self.reshape(t, [experts, r, c]), self.value(ids)], axis=0)
                         for t, c in ((packed, cols // 2), (scales, cols // group)))
            pairs = self.cast(pairs, "i32")
            high = g.node("Div", [pairs, g.const(np.array(16, np.int32))])
            low = g.node("Sub", [pairs, g.node("Mul", [high, g.const(np.array(16, np.int32))])])
            q = self.reshape(g.node("Concat", [self.unsqueeze(low, [3]), self.unsqueeze(high, [3])], axis=3),
                             [k, r, cols // group, group])
            values = self.cast(g.node("Sub", [q, g.const(np.array(8, np.int32))]), "f32")
            return self.reshape(g.node("Mul", [values, self.unsqueeze(sc, [3])]), [k, r, cols])
        blocks = self.g.node("Gather", [self.reshape(self.weight_init(w), [experts, r, cols]), self.value(ids)],
                             axis=0)
        return blocks if w.type.dtype == "f32" else self.cast(blocks, "f32")

    def rank_sum(self, x: str, n: int, axis: int) -> str:
        """x's n slices along axis summed one after another, first to last (the references' rank order; a
        ReduceSum's order is the runtime's)."""
        total = self.slice(x, axis, 0, 1)
        for j in range(1, n):
            total = self.g.node("Add", [total, self.slice(x, axis, j, j + 1)])
        return self.g.node("Squeeze", [total, self.g.i64([axis])])

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

    def rope_tables(self, pos: str, theta: float, rotary_dim: int, yarn=None):
        """cos, sin [rotary_dim] at pos: the reference's fp32 inverse frequencies (as constants) times pos; with
        YaRN (``yarn``, rope_ref) its inverse frequencies, cos and sin times its attention factor."""
        key = ("rope", theta, rotary_dim, tuple(yarn or ()))
        if key not in self.cache:
            g = self.g
            inv = g.const(rope_inv_freq(theta, rotary_dim, yarn).numpy().astype(np.float32))
            freqs = g.node("Mul", [self.cast(pos, "f32"), inv])
            emb = g.node("Concat", [freqs, freqs], axis=0)
            cos, sin = g.node("Cos", [emb]), g.node("Sin", [emb])
            if yarn:
                scale = g.const(np.array([yarn[3]], np.float32))
                cos, sin = g.node("Mul", [cos, scale]), g.node("Mul", [sin, scale])
            self.cache[key] = (cos, sin)
        return self.cache[key]

    def rope(self, x: str, d: int, pos: str, theta: float, rotary_dim: int, yarn=None) -> str:  # rope_ref
        g = self.g
        cos, sin = self.rope_tables(pos, theta, rotary_dim, yarn)
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
    def gdn_core(self, hk: int, b: str, a: str, mixed: str, a_log, dt_bias, rec: State, l2_eps: float,
                 scale: float) -> str:
        """The middle of gdn_step_ref / gdn_delta_ref: split q|k|v, L2 norms, gates, delta rule."""
        hv, dk, dv = rec.type.shape
        q = self.l2norm(self.reshape(self.slice(mixed, 0, 0, hk * dk), [hk, dk]), l2_eps)
        k = self.l2norm(self.reshape(self.slice(mixed, 0, hk * dk, 2 * hk * dk), [hk, dk]), l2_eps)
        v = self.reshape(self.slice(mixed, 0, 2 * hk * dk, 2 * hk * dk + hv * dv), [hv, dv])
        g_, beta = self.gates(a, b, a_log, dt_bias)
        return self.delta_rule(q, k, v, g_, beta, rec, hk, scale)

    # --- ops: each op kind's lowering is its record's ``onnx`` (compiler/ops.py) --------------------
    def export_op(self, i: int, op: Op) -> None:
        self.g.scope = f"op{i}.{op.kind}"
        d = OPS[op.kind]
        if isinstance(d.onnx, NotApplicable):
            raise UnsupportedError(f"ONNX export: op #{i} ({op.kind}) has no ONNX form ({d.onnx.why}); export the "
                                   f"program before hoist_dynamic (lower + fuse + quantize)")
        res = d.onnx(self, op, *op.ins)
        if d.writes_dyn or res is None:
            return
        for v, t in zip(op.outs, res if isinstance(res, tuple) else (res,)):
            self.env[id(v)] = t

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
    import_onnx()
    from onnx import TensorProto, helper

    initializers: list = []
    made: dict[str, object] = {}
    opset, ir_version = onnx_opset(program)

    def initializer(name: str, dtype: str, dims, data) -> str:
        t = TensorProto(name=name, data_type=_elem(dtype), dims=list(dims))
        if external is not None:
            offset, length = external.write(data)
            for key, value in (("location", external.location), ("offset", offset), ("length", length)):
                t.external_data.add(key=key, value=str(value))
            t.data_location = TensorProto.EXTERNAL
        else:
            t.raw_data = bytes(data)
        initializers.append(t)
        return name

    def weight_init(w: Weight) -> str:
        if is_q4(w.type.dtype):  # q4 weights are read through q4_init (codes and scales)
            raise UnsupportedError(f"ONNX export: q4 weight {w.name} read as a whole tensor (an op's lowering "
                                   f"must dequantise it: _Exporter.f32 / expert_rows)")
        if w.name not in made:
            made[w.name] = initializer(w.name, w.type.dtype, w.type.shape, produce(w.name))
        return made[w.name]

    def q4_init(w: Weight, form: str) -> tuple[str, str]:
        if w.name not in made:
            codes, scales = q4_onnx_data(w, produce(w.name), form)
            (n, k), group = w.type.shape, q4_group(w.type.dtype)
            made[w.name] = (initializer(w.name, "int4" if form == "int4" else "u8",
                                        (n, k) if form == "int4" else (n, k // 2), codes),
                            initializer(w.name + ".scale", "f32", (n, k // group), scales))
        return made[w.name]

    ex = _Exporter(program, weight_init, q4_init, opset)
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
    clash = {n for n in names if names.count(n) > 1} | (set(names) & {t.name for t in initializers})
    if clash:
        raise UnsupportedError(f"ONNX export: graph input/output names collide: {sorted(clash)[:3]}")
    graph = helper.make_graph(g.nodes, "kestrel_step", inputs, outputs, initializer=initializers + g.initializers,
                              doc_string="One Kestrel decode step (see compiler/onnx_export.py): feed <state>.out "
                                         "back as <state>, next_token as token at pos + 1.")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version,
                              producer_name="kestrel", producer_version=producer_version(),
                              doc_string="Kestrel step IR exported to ONNX")
    meta = {"kestrel.step": json.dumps(sig.to_json(), sort_keys=True)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (metadata or {}).items()})
    helper.set_model_props(model, meta)
    return model, sig


def write_onnx(program: Program, produce, out: str, external: bool | None = None,
               metadata: dict | None = None):
    """Export ``program`` and write it to ``out`` (+ ``out.data`` with external data: decided by size
    when ``external`` is None). Files appear under their names only when complete. Returns
    (ModelProto, StepSignature, data path or None)."""
    total = sum(onnx_weight_bytes(w) for w in program.weights.values())
    if external is None:
        external = total > EXTERNAL_THRESHOLD
    data_path = out + ".data" if external else None
    tmp, sink = out + ".tmp", None
    try:
        sink = _ExternalData(data_path + ".tmp", os.path.basename(data_path)) if external else None
        model_proto, sig = export_program(program, produce, external=sink, metadata=metadata)
        if sink is not None:
            sink.close()
        with open(tmp, "wb") as f:
            f.write(model_proto.SerializeToString())
        if sink is not None:
            os.replace(sink.path, data_path)
        os.replace(tmp, out)
    except BaseException as e:
        if sink is not None:
            sink.f.close()
        for path in (tmp, sink.path if sink else None):
            if path and os.path.exists(path):
                os.remove(path)
        if isinstance(e, OSError):  # a full disk, a read-only filesystem: one line, nothing left behind
            raise OutputError(f"-o {out}: writing failed ({e.strerror or e}); nothing was left behind") from None
        raise
    return model_proto, sig, data_path
