"""Text form of the step IR: ``print_program`` and ``parse_program`` round-trip exactly.

    kestrel.step v1
    dyn pos:i32
    weight embed_tokens : f32[512,128]
    state layers.0.conv : f32[384,3]
    %0 : f32[128] = embedding embed_tokens, dyn.token
    %1 : f32[128] = rmsnorm %0, layers.0.input_layernorm {eps=1e-06}
    kv_append layers.3.k_cache, layers.3.v_cache, %7, %8, dyn.pos
    dyn.sampled = sample %40, dyn.temperature, dyn.top_p, dyn.seed, dyn.pos
    output logits %40

Values are numbered %0, %1, ... in order of definition when printed (names are not stored), so
adding an op does not rename anything before it. Weights and states are referred to by their
declared names (one namespace for both), dyn slots as ``dyn.NAME``. Attributes are ints, floats
(Python ``repr``, exact), quoted strings, booleans, or ``[int, ...]`` lists. Blank lines and lines
starting with ``#`` are ignored by the parser.
"""
from __future__ import annotations

import json
import re

from kestrel.compiler.ir import Dyn, IRError, Op, Program, TensorType, Value
from kestrel.compiler.ops import OPS, verify

HEADER = "kestrel.step v1"


def _fmt_attr(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt_attr(x) for x in v) + "]"
    raise IRError(f"attribute value {v!r} has no text form")


def _loc(x) -> str:
    return f" @{x.loc[0]}+{x.loc[1]}" if x.loc is not None else ""


def _fmt_attrs(attrs: dict) -> str:
    return "{" + ", ".join(f"{k}={_fmt_attr(v)}" for k, v in attrs.items()) + "}"


def print_program(program: Program) -> str:
    lines = [HEADER]
    if program.target is not None:
        lines.append(f"target {program.target}")
    if program.arena:
        lines.append("arena " + " ".join(f"{k}={v}" for k, v in program.arena.items()))
    lines += [f"dyn {d.name}:{d.dtype}{' host' if d.host else ''}{_loc(d)}" for d in program.dyn.values()]
    lines += [f"weight {w.name} : {w.type}"
              + (f" <- {json.dumps(w.source, separators=(',', ':'))}" if w.source is not None else "") + _loc(w)
              for w in program.weights.values()]
    lines += [f"state {s.name} : {s.type}{_loc(s)}" for s in program.states.values()]
    names: dict[int, str] = {}

    def ref(x) -> str:
        if isinstance(x, Value):
            try:
                return names[id(x)]
            except KeyError:
                raise IRError("a value is used before the op that defines it") from None
        if isinstance(x, Dyn):
            return f"dyn.{x.name}"
        return x.name

    for op in program.ops:
        outs = []
        for o in op.outs:
            if isinstance(o, Value):
                names[id(o)] = f"%{len(names)}"
                outs.append(f"{names[id(o)]} : {o.type}{_loc(o)}")
            else:
                outs.append(ref(o))
        text = f"{op.kind} " + ", ".join(ref(x) for x in op.ins) if op.ins else op.kind
        if op.attrs:
            text += " " + _fmt_attrs(op.attrs)
        if op.launch is not None:
            text += " launch" + _fmt_attrs(op.launch)
        lines.append((", ".join(outs) + " = " + text) if outs else text)
    lines += [f"output {name} {ref(v)}" for name, v in program.outputs.items()]
    return "\n".join(lines) + "\n"


_TYPE_RE = re.compile(r"^(\w+)\[([0-9,]*)\]$")
_RESULT_RE = re.compile(r"%\d+\s*:\s*\w+\[[0-9,]*\](?:\s*@\w+\+\d+)?|dyn\.\w+")
_LOC_RE = re.compile(r"\s+@(\w+)\+(\d+)$")


def _split_loc(s: str):
    m = _LOC_RE.search(s)
    if not m:
        return s, None
    return s[:m.start()], (m.group(1), int(m.group(2)))
_ATTR_RE = re.compile(r'\s*(\w+)\s*=\s*("(?:[^"\\]|\\.)*"|\[[^\]]*\]|[^,}]+)\s*(?:,|$)')


def _parse_type(s: str, where: str) -> TensorType:
    m = _TYPE_RE.match(s.strip())
    if not m:
        raise IRError(f"{where}: bad type {s.strip()!r} (expected like f32[4,16])")
    shape = tuple(int(d) for d in m.group(2).split(",") if d)
    return TensorType(m.group(1), shape)


def _parse_attr_value(s: str, where: str):
    s = s.strip()
    if s in ("true", "false"):
        return s == "true"
    if s.startswith('"'):
        return json.loads(s)
    if s.startswith("["):
        return [_parse_attr_value(x, where) for x in s[1:-1].split(",") if x.strip()]
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        raise IRError(f"{where}: bad attribute value {s!r}") from None


def _parse_attrs(s: str, where: str) -> dict:
    attrs = {}
    pos = 0
    while pos < len(s):
        m = _ATTR_RE.match(s, pos)
        if not m:
            raise IRError(f"{where}: bad attributes {s!r}")
        attrs[m.group(1)] = _parse_attr_value(m.group(2), where)
        pos = m.end()
    return attrs


def parse_program(text: str) -> Program:
    """Parse the text form; raises IRError with the line number on any malformed line."""
    prog = Program()
    values: dict[str, Value] = {}
    lines = text.splitlines()
    first = next((i for i, l in enumerate(lines) if l.strip() and not l.lstrip().startswith("#")), None)
    if first is None or lines[first].strip() != HEADER:
        raise IRError(f"missing header line {HEADER!r}")

    def operand(tok: str, where: str):
        tok = tok.strip()
        if tok.startswith("%"):
            if tok not in values:
                raise IRError(f"{where}: {tok} is used before it is defined")
            return values[tok]
        if tok.startswith("dyn."):
            name = tok[4:]
            if name not in prog.dyn:
                raise IRError(f"{where}: dyn slot {name!r} is not declared")
            return prog.dyn[name]
        if tok in prog.weights:
            return prog.weights[tok]
        if tok in prog.states:
            return prog.states[tok]
        raise IRError(f"{where}: unknown operand {tok!r}")

    for lineno, raw in enumerate(lines[first + 1:], start=first + 2):
        line = raw.strip()
        where = f"line {lineno}"
        if not line or line.startswith("#"):
            continue
        head, _, rest = line.partition(" ")
        if head == "target" and " = " not in rest:
            prog.target = rest.strip()
            continue
        if head == "arena" and " = " not in rest:
            for item in rest.split():
                k, _, v = item.partition("=")
                prog.arena[k] = int(v)
            continue
        if head == "dyn" and ":" in rest and " = " not in rest:
            rest, loc = _split_loc(rest)
            name, _, dt = rest.partition(":")
            dt, _, flag = dt.strip().partition(" ")
            if flag not in ("", "host"):
                raise IRError(f"{where}: bad dyn slot flag {flag!r} (only 'host')")
            prog.add_dyn(name.strip(), dt, host=flag == "host").loc = loc
            continue
        if head in ("weight", "state"):
            rest, loc = _split_loc(rest)
            name, _, t = rest.partition(" : ")
            t, _, src = t.partition(" <- ")
            name = name.strip()
            if name in prog.weights or name in prog.states:
                raise IRError(f"{where}: {name!r} declared twice")
            typ = _parse_type(t, where)
            if head == "weight":
                try:
                    source = json.loads(src) if src else None
                except json.JSONDecodeError:
                    raise IRError(f"{where}: weight source {src!r} is not valid JSON") from None
                prog.add_weight(name, typ.dtype, typ.shape, source).loc = loc
            else:
                prog.add_state(name, typ.dtype, typ.shape).loc = loc
            continue
        if head == "output":
            name, _, v = rest.partition(" ")
            prog.outputs[name] = operand(v, where)
            continue
        lhs, eq, rhs = line.partition(" = ") if " = " in line else ("", "", line)
        attrs, launch = {}, None
        if rhs.endswith("}") and " launch{" in rhs:
            rhs, _, launch_text = rhs.rpartition(" launch{")
            launch = _parse_attrs(launch_text[:-1], where)
        if rhs.endswith("}") and "{" in rhs:
            rhs, _, attr_text = rhs.partition(" {")
            attrs = _parse_attrs(attr_text[:-1], where)
        kind, _, args = rhs.strip().partition(" ")
        if kind not in OPS:
            raise IRError(f"{where}: unknown op {kind!r}")
        ins = [operand(a, where) for a in args.split(",")] if args.strip() else []
        outs = []
        lhs_items = _RESULT_RE.findall(lhs)
        if re.sub(r"[\s,]", "", "".join(lhs_items)) != re.sub(r"[\s,]", "", lhs):
            raise IRError(f"{where}: bad results {lhs!r} (expected like %3 : f32[8], %4 : f32[8])")
        for o in lhs_items:
            o = o.strip()
            if o.startswith("dyn."):
                outs.append(operand(o, where))
                continue
            o, loc = _split_loc(o)
            name, _, t = o.partition(" : ")
            if not name.startswith("%") or not t:
                raise IRError(f"{where}: bad result {o!r} (expected like %3 : f32[8])")
            if name in values:
                raise IRError(f"{where}: {name} defined twice")
            values[name] = Value(_parse_type(t, where), loc)
            outs.append(values[name])
        prog.ops.append(Op(kind, outs, ins, attrs, launch))
    verify(prog)
    return prog
