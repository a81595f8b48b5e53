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
not churn when an unrelated op is added. This file is the data model only: what each op kind is
(operands, shape rule, reference, kernel, ONNX form) is its record in ``compiler/ops.py``, which
also holds ``verify`` and ``emit``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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


def q4_placements(weights) -> list[tuple[int, int, int, int]]:
    """(byte offset, N, K, group) of each placed q4 weight: where a random-weights fill puts its scales
    (kernels/fill.py fill_runs)."""
    return sorted({(w.loc[1], *w.type.shape, q4_group(w.type.dtype)) for w in weights if is_q4(w.type.dtype)})


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

    def weight_bytes(self) -> int:
        return sum(w.type.nbytes for w in self.weights.values())

    def state_bytes(self) -> int:
        return sum(s.type.nbytes for s in self.states.values())
