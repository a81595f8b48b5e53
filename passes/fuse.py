"""fuse: merge elementwise chains into the kernels that produce or consume them.

Invariant established: no elementwise op is left where a fused kernel can absorb it; the math is
unchanged op for op (each fused op's reference composes the single-op references in the same
order, so the CPU path gives bit-identical logits before and after). Rewrites, in this order:

  1. ``swiglu(matmul(x, Wg), matmul(x, Wu))``          -> ``matmul_swiglu(x, Wg, Wu)``
  2. the Gated DeltaNet chain after its projections    -> ``gdn_delta`` (conv1d_step reading the conv
     state, slices, l2norms, gdn_gates, gated_delta_step) then ``gdn_norm`` (gated_rmsnorm, and the
     conv-state shift): two launches, so that the delta rule can run one program per column block
     of each value head's state (the conv state's q/k rows are shared by a key head's value heads
     and can only be shifted once all of them have read it; the norm needs a head's whole row)
  3. the gated attention chain after its projections   -> ``attn_step`` (q|gate split, q/k rmsnorm,
     rope, kv_append, attention split over kv heads and the sequence, sigmoid_gate), with the
     scratch states its split needs (``scratch.attn_partials``, ``scratch.attn_tickets``, shared by
     all its layers), made with one split: the target's split count is select_kernels' decision
  4. ``add`` feeding an ``rmsnorm``                    -> ``add_rmsnorm`` (residual add + next norm); the
     one-token ``embedding`` feeding one                -> ``embedding_rmsnorm`` (the gather + the first
     layer's norm in one program: a launch fewer a token, ~1.4 us at 0.8B on the H200)
  5. sibling ``matmul``s reading the same vector with weights of one dtype -> one ``matmul`` on the
     row-concatenated weight, its result sliced back (slices of a vector are free views; at M rows
     the slices are along the last axis); the same siblings read by another vector (the MTP head's
     rows and its one-row drafts) share that weight
  6. at M rows, the row mixers reading column slices of one projection matrix (what 5 made) read the
     matrix itself, with the columns as offsets (a column slice of [M, N] is not a view):
     ``gdn_rows`` + its ``gated_rmsnorm`` -> ``gdn_rows_delta`` then ``gdn_rows_norm`` (the same split,
     for the same reason, as 2; the speculative verify's ``gdn_rows_snap`` likewise -> ``gdn_rows_delta_snap``
     then ``gdn_rows_norm_snap``); ``attn_rows`` -> ``attn_rows_kv`` (the chunk's keys and values into
     the caches) then ``attn_rows_q`` (the queries over the caches: every row's K/V is in place before
     any query reads it)
  7. at one row, an ``add_rmsnorm`` between two matrix products (the residual add after a mixer's or
     MLP's output projection, and the next norm, read only by ``matmul`` / ``matmul_swiglu``s, or
     Qwen3-Next's router ``matmul`` and ``moe_gate_up``) is folded into them: the producer becomes
     ``matmul_add`` (``moe_down_add`` after a MoE block: s = r + W x, and the partial sums of s^2
     per ``partial_rows`` rows: one partial here, select_kernels sets the GPU kernel's), each consumer
     ``rmsnorm_matmul`` / ``rmsnorm_matmul_swiglu`` / ``rmsnorm_moe_gate_up`` (W @ rmsnorm(s), the input normed per tile,
     its mean square from s itself or from the partials: the kernel's choice): no launch of its own, and no pass of one program over the whole vector
     (kernels/matvec.py). The final norm stays (its result is the ``hidden`` output)
  8. ops whose results nobody reads, and that write no state, are dropped.
  (after 1) Qwen3-Next's ``moe_experts`` -> ``moe_gate_up`` then ``moe_down`` (the routed and shared
     experts' gate/up products in one grouped launch, then their down products summed in a fixed order;
     kernels/moe.py), the expert ids read from the router's routing buffer by both; from GROUPED_MIN_ROWS rows
     grouped by expert instead (moe_group, moe_gate_up_grouped, moe_down_grouped, the shared expert's two
     matmuls, moe_combine: each expert's weights read once for a chunk of its rows); ``moe_router`` ->
     the router's ``matmul`` (its logits) then ``moe_topk`` (softmax, top-k, the routing buffer)

A chain that does not match its pattern exactly is left as it is (still correct, just unfused).
``check`` proves the invariant: every rewrite, run again on the result, finds nothing to do.
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import SCRATCH_PREFIX, IRError, Op, Program, TensorType, Value, Weight
from kestrel.compiler.ops import OPS
from kestrel.kernels.moe import GROUPED_CHUNK, grouped_chunks

ATTN_PARTIALS, ATTN_TICKETS = SCRATCH_PREFIX + "attn_partials", SCRATCH_PREFIX + "attn_tickets"


class _Graph:
    """Def-use view of a program, rebuilt after each rewrite round."""

    def __init__(self, p: Program):
        self.p = p
        self.producer: dict[int, Op] = {}
        self.users: dict[int, list[Op]] = {}
        for op in p.ops:
            for o in op.outs:
                if isinstance(o, Value):
                    self.producer[id(o)] = op
            for x in op.ins:
                if isinstance(x, Value):
                    self.users.setdefault(id(x), []).append(op)
        self.outputs = {id(v) for v in p.outputs.values()}

    def prod(self, v, kind: str, **attrs) -> Op | None:
        """The op of ``kind`` that defines ``v`` (with these attribute values), or None."""
        op = self.producer.get(id(v)) if isinstance(v, Value) else None
        if op is None or op.kind != kind or any(op.attrs.get(k) != a for k, a in attrs.items()):
            return None
        return op

    def only_user(self, v) -> Op | None:
        us = self.users.get(id(v), [])
        return us[0] if len(us) == 1 and id(v) not in self.outputs else None


def _replace_uses(p: Program, old: Value, new: Value) -> None:
    for op in p.ops:
        op.ins = [new if x is old else x for x in op.ins]
    for k, v in p.outputs.items():
        if v is old:
            p.outputs[k] = new


def _fuse_swiglu(p: Program) -> int:
    g, n = _Graph(p), 0
    for op in list(p.ops):
        if op.kind != "swiglu":
            continue
        mg, mu = g.prod(op.ins[0], "matmul"), g.prod(op.ins[1], "matmul")
        if not (mg and mu and mg.ins[0] is mu.ins[0] and g.only_user(mg.outs[0]) and g.only_user(mu.outs[0])
                and mg.ins[1].type == mu.ins[1].type):
            continue
        fused = Op("matmul_swiglu", [op.outs[0]], [mg.ins[0], mg.ins[1], mu.ins[1]])
        p.ops[p.ops.index(op)] = fused
        p.ops.remove(mg)
        p.ops.remove(mu)
        n += 1
    return n


def _slice_reshape(g: _Graph, v, src, start: int, stop: int):
    """v == reshape(slice(src, axis 0, start:stop)) ?"""
    r = g.prod(v, "reshape")
    s = r and g.prod(r.ins[0], "slice", axis=0, start=start, stop=stop)
    return bool(s) and s.ins[0] is src


def _fuse_gdn(p: Program) -> int:
    g, n = _Graph(p), 0
    for op in list(p.ops):
        if op.kind != "gated_delta_step":
            continue
        q, k, v, gg, beta, rec = op.ins
        hv, dk, dv = rec.type.shape
        hk = q.type.shape[0]
        lq, lk = g.prod(q, "l2norm"), g.prod(k, "l2norm")
        gates = g.prod(gg, "gdn_gates")
        vr = g.prod(v, "reshape")
        vs = vr and g.prod(vr.ins[0], "slice", axis=0, start=2 * hk * dk)
        conv = vs and g.prod(vs.ins[0], "conv1d_step", act="silu")
        norm = g.only_user(op.outs[0])
        if not (lq and lk and gates and conv and norm and norm.kind == "gated_rmsnorm" and beta is gates.outs[1]
                and lq.attrs == lk.attrs and norm.ins[0] is op.outs[0]):
            continue
        mixed = conv.outs[0]
        if not (_slice_reshape(g, lq.ins[0], mixed, 0, hk * dk) and _slice_reshape(g, lk.ins[0], mixed, hk * dk,
                                                                                   2 * hk * dk)):
            continue
        zr = g.prod(norm.ins[1], "reshape")
        flat = g.only_user(norm.outs[0])
        if not (zr and flat and flat.kind == "reshape"):
            continue
        qkv, conv_state, conv_w = conv.ins
        a, b, a_log, dt_bias = gates.ins
        o_raw = Value(TensorType("f32", (hv * dv,)))
        delta = Op("gdn_delta", [o_raw], [qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec],
                   {"l2_eps": lq.attrs["eps"], "scale": op.attrs["scale"]})
        gnorm = Op("gdn_norm", [flat.outs[0]], [o_raw, zr.ins[0], qkv, norm.ins[2], conv_state],
                   {"eps": norm.attrs["eps"]})
        i = p.ops.index(flat)  # where the result was defined; all operands are defined earlier
        p.ops[i:i + 1] = [delta, gnorm]
        for dead in (conv, lq, lk, gates, op, norm):
            p.ops.remove(dead)
        n += 1
    return n


def _fuse_attention(p: Program) -> int:
    g, n = _Graph(p), 0
    for op in list(p.ops):
        if op.kind != "attention":
            continue
        q, kc, vc, pos = op.ins
        d = kc.type.shape[2]
        rq = g.prod(q, "rope")
        nq = rq and g.prod(rq.ins[0], "rmsnorm")
        sq = nq and g.prod(nq.ins[0], "slice", axis=1, start=0, stop=d)
        qg2 = sq and g.prod(sq.ins[0], "reshape")
        app = next((u for u in p.ops if u.kind == "kv_append" and u.ins[0] is kc and u.ins[1] is vc), None)
        if not (rq and nq and sq and qg2 and app) or p.ops.index(app) > p.ops.index(op):
            continue
        rk = g.prod(app.ins[2], "rope", **rq.attrs)
        nk = rk and g.prod(rk.ins[0], "rmsnorm", **nq.attrs)
        kr = nk and g.prod(nk.ins[0], "reshape")
        vr = g.prod(app.ins[3], "reshape")
        flat = g.only_user(op.outs[0])
        gate = flat and flat.kind == "reshape" and g.only_user(flat.outs[0])
        if not (kr and vr and gate and gate.kind == "sigmoid_gate" and gate.ins[0] is flat.outs[0]):
            continue
        gr = g.prod(gate.ins[1], "reshape")
        gs = gr and g.prod(gr.ins[0], "slice", axis=1, start=d, stop=2 * d)
        if not (gs and gs.ins[0] is qg2.outs[0] and app.ins[4] is pos and rq.ins[1] is pos and rk.ins[1] is pos):
            continue
        part, ticket = _attention_scratch(p, kc.type.shape, qg2.ins[0].type.shape[0])
        fused = Op("attn_step", [gate.outs[0]],
                   [qg2.ins[0], kr.ins[0], vr.ins[0], nq.ins[1], nk.ins[1], kc, vc, pos, part, ticket],
                   {"eps": nq.attrs["eps"], **_rope_attrs(rq.attrs), "scale": op.attrs["scale"]})
        p.ops[p.ops.index(gate)] = fused
        for dead in (rq, nq, rk, nk, app, op, flat):
            p.ops.remove(dead)
        n += 1
    return n


def _rope_attrs(attrs: dict) -> dict:
    """The RoPE attributes a fused attention op takes over from the op it replaces (theta, rotary_dim, yarn)."""
    return {k: attrs[k] for k in ("theta", "rotary_dim", "yarn") if k in attrs}


def _attention_scratch(p: Program, cache_shape, qg_size: int):
    """The scratch states every attn_step of the program shares (attention layers run one after the
    other): per query head and sequence split a partial (m, l, acc[D]), and a ticket per query head
    (the kernel, one program per kv head and split, counts on the first NKV: one per kv head). Made
    with one split: how many the target's kernel uses is select_kernels' decision (it resizes them)."""
    _, _, d = cache_shape
    nh = qg_size // (2 * d)
    if ATTN_PARTIALS not in p.states:
        p.add_state(ATTN_PARTIALS, "f32", (nh, 1, d + 2))
        p.add_state(ATTN_TICKETS, "i32", (nh,))
    return p.states[ATTN_PARTIALS], p.states[ATTN_TICKETS]


def _rows_attention_scratch(p: Program, rows: int, d: int):
    """The scratch states every attn_rows_q of an M-row program shares: partials and tickets of its split over
    the sequence, named by the row count (a plan's programs at other row counts split differently; the
    arena keeps one placement per name). Made unsplit: select_kernels sizes them for the target's launch."""
    part, tickets = f"{SCRATCH_PREFIX}attn_rows{rows}_partials", f"{SCRATCH_PREFIX}attn_rows{rows}_tickets"
    if part not in p.states:
        p.add_state(part, "f32", (1, d + 2))
        p.add_state(tickets, "i32", (1,))
    return p.states[part], p.states[tickets]


def _fuse_add_rmsnorm(p: Program) -> int:
    g, count = _Graph(p), 0
    for op in list(p.ops):
        if op.kind != "rmsnorm":
            continue
        add = g.prod(op.ins[0], "add")
        if add is None or any(u.kind == "rmsnorm" and u is not op and p.ops.index(u) < p.ops.index(op)
                              for u in g.users[id(add.outs[0])]):
            continue
        s, n = Value(add.outs[0].type), op.outs[0]
        fused = Op("add_rmsnorm", [s, n], [add.ins[0], add.ins[1], op.ins[1]], dict(op.attrs))
        p.ops[p.ops.index(add)] = fused
        p.ops.remove(op)
        _replace_uses(p, add.outs[0], s)
        g = _Graph(p)
        count += 1
    return count


def _fuse_embedding_rmsnorm(p: Program) -> int:
    g, count = _Graph(p), 0
    for op in list(p.ops):
        emb = g.prod(op.ins[0], "embedding") if op.kind == "rmsnorm" else None
        if emb is None or any(u.kind == "rmsnorm" and u is not op and p.ops.index(u) < p.ops.index(op)
                              for u in g.users[id(emb.outs[0])]):
            continue
        x, n = Value(emb.outs[0].type), op.outs[0]
        p.ops[p.ops.index(emb)] = Op("embedding_rmsnorm", [x, n], [*emb.ins, op.ins[1]], dict(op.attrs))
        p.ops.remove(op)
        _replace_uses(p, emb.outs[0], x)
        g = _Graph(p)
        count += 1
    return count


def _concat_name(weights: list[Weight]) -> str:
    names = [w.name for w in weights]
    prefix = names[0].rsplit(".", 1)[0] + "."
    if all(n.startswith(prefix) for n in names):
        return prefix + "+".join(n[len(prefix):] for n in names)
    return "+".join(names)


def _concat_siblings(p: Program) -> int:
    n_cat = 0
    groups: dict[tuple, list[Op]] = {}
    for op in p.ops:
        if op.kind == "matmul" and isinstance(op.ins[1], Weight) and op.ins[1].source is not None:
            w = op.ins[1]
            groups.setdefault((id(op.ins[0]), w.type.dtype, w.type.shape[1]), []).append(op)
    for ops in groups.values():
        if len(ops) < 2:
            continue
        ws = [op.ins[1] for op in ops]
        rows = sum(w.type.shape[0] for w in ws)
        name = _concat_name(ws)
        source = ["concat", 0] + [w.source for w in ws]
        cat = p.weights.get(name)
        if cat is None:
            cat = p.add_weight(name, ws[0].type.dtype, (rows, ws[0].type.shape[1]), source)
        elif cat.source != source or cat.type != type(ws[0].type)(ws[0].type.dtype, (rows, ws[0].type.shape[1])):
            continue  # (the same weights read by another input, e.g. the MTP head's rows and its one-row drafts,
            # share one concatenation)
        lead = ops[0].ins[0].type.shape[:-1]  # () for one row, (M,) for M rows
        out = Value(TensorType("f32", lead + (rows,)))
        first = min(p.ops.index(op) for op in ops)
        new_ops, start = [Op("matmul", [out], [ops[0].ins[0], cat])], 0
        for op in ops:
            n = op.outs[0].type.shape[-1]
            new_ops.append(Op("slice", [op.outs[0]], [out], {"axis": len(lead), "start": start, "stop": start + n}))
            start += n
        for op in ops:
            p.ops.remove(op)
        p.ops[first:first] = new_ops
        n_cat += 1
    # weights no op reads any more (their rows now live in the concatenation) are dropped
    used = {x.name for op in p.ops for x in op.ins if isinstance(x, Weight)}
    for name in [n for n in p.weights if n not in used]:
        del p.weights[name]
    return n_cat


def _column_slices(g: _Graph, values) -> tuple[Value, list[int]] | None:
    """(x, starts) when every value is a column slice (axis 1) of one [M, N] matrix x, else None."""
    ops = [g.prod(v, "slice", axis=1) for v in values]
    if not all(ops) or any(op.ins[0] is not ops[0].ins[0] for op in ops):
        return None
    return ops[0].ins[0], [op.attrs["start"] for op in ops]


def _fuse_rows(p: Program) -> int:
    g, n = _Graph(p), 0
    for op in list(p.ops):
        if op.kind in ("gdn_rows", "gdn_rows_snap"):
            qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec, pos, n_prompt = op.ins[:10]
            snap = op.kind == "gdn_rows_snap"  # the speculative verify's: the states after each row kept
            cols = _column_slices(g, (qkv, b, a))
            r1 = g.only_user(op.outs[0])
            norm = r1 and r1.kind == "reshape" and g.only_user(r1.outs[0])
            flat = norm and norm.kind == "gated_rmsnorm" and norm.ins[0] is r1.outs[0] and g.only_user(norm.outs[0])
            zr = flat and flat.kind == "reshape" and g.prod(norm.ins[1], "reshape")
            zcols = zr and _column_slices(g, (zr.ins[0],))
            if not (cols and zcols and zcols[0] is cols[0]):
                continue
            x, (c_qkv, c_b, c_a) = cols
            o_raw = Value(TensorType("f32", op.outs[0].type.shape))
            delta = Op("gdn_rows_delta_snap" if snap else "gdn_rows_delta", [o_raw],
                       [x, conv_state, conv_w, a_log, dt_bias, rec, pos, n_prompt] + op.ins[10:11],
                       {"qkv": c_qkv, "b": c_b, "a": c_a, **op.attrs})
            gnorm = Op("gdn_rows_norm_snap" if snap else "gdn_rows_norm", [flat.outs[0]],
                       [o_raw, x, norm.ins[2], conv_state, pos, n_prompt] + op.ins[11:12],
                       {"z": zcols[1][0], "qkv": c_qkv, "eps": norm.attrs["eps"]})
            i = p.ops.index(flat)
            p.ops[i:i + 1] = [delta, gnorm]
            for dead in (op, r1, norm):
                p.ops.remove(dead)
            n += 1
        elif op.kind == "attn_rows":
            qg, k, v, qn, kn, kc, vc, pos, n_prompt = op.ins
            cols = _column_slices(g, (qg, k, v))
            if not cols:
                continue
            x, (c_q, c_k, c_v) = cols
            d = kc.type.shape[2]
            a = op.attrs
            rope = {"eps": a["eps"], **_rope_attrs(a)}
            kv = Op("attn_rows_kv", [], [x, kn, kc, vc, pos, n_prompt], {"k": c_k, "v": c_v, **rope})
            part, tickets = _rows_attention_scratch(p, x.type.shape[0], d)
            q = Op("attn_rows_q", [op.outs[0]], [x, qn, kc, vc, pos, n_prompt, part, tickets],
                   {"q": c_q, "heads": qg.type.shape[1] // (2 * d), **rope, "scale": a["scale"]})
            i = p.ops.index(op)
            p.ops[i:i + 1] = [kv, q]
            n += 1
    return n


# rule 7: the ops that can produce the residual add's operand (-> the op that also adds and makes the
# partials) and the ops that can consume the norm (-> the op that norms its input per tile)
NORM_PRODUCERS = {"matmul": "matmul_add", "moe_down": "moe_down_add"}
NORM_CONSUMERS = {"matmul": "rmsnorm_matmul", "matmul_swiglu": "rmsnorm_matmul_swiglu",
                  "moe_gate_up": "rmsnorm_moe_gate_up"}


def fold_norms_into_matmuls(p: Program, rows: bool = False, accept=None) -> int:
    """Rule 7 (at one row), or at M rows (``rows``: passes/fold_row_norms.py) where ``accept(producer,
    consumers)`` says the kernels can take it; returns the number of add_rmsnorms folded."""
    g, n = _Graph(p), 0
    for op in list(p.ops):
        if op.kind != "add_rmsnorm" or len(op.ins[0].type.shape) != (2 if rows else 1):
            continue
        r, y, nw = op.ins
        mm = g.producer.get(id(y))
        if mm is None or mm.kind not in NORM_PRODUCERS or not g.only_user(y):
            continue  # (the product is the add's second operand, the residual its first)
        s, normed = op.outs
        users = g.users.get(id(normed), [])
        if not users or id(normed) in g.outputs or any(
                u.kind not in NORM_CONSUMERS or u.ins[0] is not normed for u in users):
            continue
        if accept is not None and not accept(mm, users):
            continue
        ss = Value(TensorType("f32", y.type.shape[:-1] + (1,)))
        p.ops[p.ops.index(op)] = Op(NORM_PRODUCERS[mm.kind], [s, ss], [*mm.ins, r], {"partial_rows": y.type.shape[-1]})
        p.ops.remove(mm)
        for u in users:
            p.ops[p.ops.index(u)] = Op(NORM_CONSUMERS[u.kind], u.outs, [s, ss, nw, *u.ins[1:]],
                                       {**u.attrs, "eps": op.attrs["eps"]})
        g = _Graph(p)
        n += 1
    return n


def _drop_dead(p: Program) -> int:
    n = 0
    while True:
        g = _Graph(p)
        dead = [op for op in p.ops
                if not OPS[op.kind].inout and not OPS[op.kind].writes_dyn and op.outs
                and all(isinstance(o, Value) and not g.users.get(id(o)) and id(o) not in g.outputs for o in op.outs)]
        if not dead:
            return n
        for op in dead:
            p.ops.remove(op)
        n += len(dead)


def _split_moe(p: Program) -> int:
    """moe_experts -> moe_gate_up (the k routed experts' and the shared expert's silu(gate) * up, and the
    shared gate's logit, in one grouped launch) then moe_down (the weighted sum of the down projections):
    two launches, because every output row of the down projection needs all of an expert's intermediate."""
    n = 0
    for op in list(p.ops):
        if op.kind != "moe_experts":
            continue
        x, ids, wts, wg, wu, wd, sg, su, sd, sgate = op.ins
        h = x.type.shape[-1]
        experts, k = wd.type.shape[0] // h, ids.type.shape[-1]
        i = p.ops.index(op)
        if len(x.type.shape) == 2 and x.type.shape[0] >= GROUPED_MIN_ROWS:
            p.ops[i:i + 1] = _grouped_moe(op, experts)
        else:
            act = Value(TensorType("f32", tuple(x.type.shape[:-1]) + (k * wd.type.shape[1] + sg.type.shape[0] + 1,)))
            p.ops[i:i + 1] = [Op("moe_gate_up", [act], [x, ids, wg, wu, sg, su, sgate], {"experts": experts}),
                              Op("moe_down", [op.outs[0]], [act, ids, wts, wd, sd])]
        n += 1
    return n


# from this many rows (the M-row step prefilling a prompt; not a speculative verify's k + 1) the MoE block runs
# grouped by expert (kernels/moe.py: each expert's weights read once for a chunk of its rows)
GROUPED_MIN_ROWS = 16


def _grouped_moe(op: Op, experts: int) -> list[Op]:
    """moe_experts at M rows -> moe_group (the pairs sorted by expert, the chunk table), the routed experts'
    gate / up and down over the chunks (moe_gate_up_grouped, moe_down_grouped), the shared expert as two
    ordinary M-row matmuls, and moe_combine (each row's k results in rank order + the gated shared one)."""
    x, ids, wts, wg, wu, wd, sg, su, sd, sgate = op.ins
    m, h = x.type.shape
    pairs = m * ids.type.shape[1]
    chunk = GROUPED_CHUNK
    src, pos = Value(TensorType("i32", (pairs,))), Value(TensorType("i32", (pairs,)))
    chunks = Value(TensorType("i32", (grouped_chunks(pairs, experts, chunk), 4)))
    act = Value(TensorType("f32", (pairs, wg.type.shape[0] // experts)))
    ys = Value(TensorType("f32", (pairs, h)))
    sh_act = Value(TensorType("f32", (m, sg.type.shape[0])))
    sh = Value(TensorType("f32", (m, h)))
    return [Op("moe_group", [src, pos, chunks], [ids], {"experts": experts, "chunk": chunk}),
            Op("moe_gate_up_grouped", [act], [x, src, chunks, wg, wu], {"experts": experts, "chunk": chunk}),
            Op("moe_down_grouped", [ys], [act, chunks, wd], {"experts": experts, "chunk": chunk}),
            Op("matmul_swiglu", [sh_act], [x, sg, su]),
            Op("matmul", [sh], [sh_act, sd]),
            Op("moe_combine", [op.outs[0]], [ys, pos, wts, x, sgate, sh])]


def _split_router(p: Program) -> int:
    """moe_router -> the router's matmul (the E logits on the matvec's many programs: one program reading
    the whole [E, H] router took 147 us a layer at Qwen3-Next-80B's shape on the H200) then moe_topk (the
    softmax and top-k of the logits, one program a row)."""
    n = 0
    for op in list(p.ops):
        if op.kind != "moe_router":
            continue
        x, w = op.ins
        logits = Value(TensorType("f32", tuple(x.type.shape[:-1]) + (w.type.shape[0],)))
        i = p.ops.index(op)
        p.ops[i:i + 1] = [Op("matmul", [logits], [x, w]), Op("moe_topk", op.outs, [logits], dict(op.attrs))]
        n += 1
    return n


REWRITES = (("matmul_swiglu", _fuse_swiglu), ("moe_gate_up + moe_down", _split_moe), ("moe_topk", _split_router), ("gdn_delta + gdn_norm", _fuse_gdn), ("attn_step", _fuse_attention),
            ("add_rmsnorm", _fuse_add_rmsnorm), ("embedding_rmsnorm", _fuse_embedding_rmsnorm), ("sibling matmuls", _concat_siblings), ("row mixers", _fuse_rows),
            ("norm into matmuls", fold_norms_into_matmuls), ("dead ops", _drop_dead))


def fuse(program: Program) -> Program:
    p = copy.deepcopy(program)
    for _, rewrite in REWRITES:
        rewrite(p)
    return p


def check(program: Program) -> None:
    """No rewrite matches any more: running each on the result changes nothing."""
    p = copy.deepcopy(program)
    left = [f"{n} {name}" for name, rewrite in REWRITES if (n := rewrite(p))]
    if left:
        raise IRError(f"fuse: matchable chains left after the pass: {', '.join(left)}")
