"""Lowering of the Qwen3.5 text model to one static decode step (M = 1) in the step IR.

One op per model operation: nothing is fused or quantized here (that is the passes' job). Every
per-token quantity (input token, position, sampling settings) is a dyn slot; states (conv windows,
recurrent states, KV caches of ``max_seq`` rows) are declared with fixed shapes.

Weights are named after the checkpoint, relative to the text model and without ``.weight``
(``layers.3.self_attn.q_proj``), declared f32 with their checkpoint tensor as source.

Straight out of the lowering, the dyn slots are *host* slots (passed with every launch, as an eager
framework would) and the host advances pos and feeds the next token in; hoist_dynamic moves them
into the device dyn buffer and adds the step_end op, which feeds the next token from the ``tokens``
state: the request's sequence (prompt ids written once by the host, then the sampled tokens, which
the host copies back every few steps) of ``n_prompt`` prompt tokens.

``lower_speculative`` builds a speculative plan's two further programs (``--speculative mtp``): the
speculative prefill and one speculative iteration (K drafts of the model's MTP head, the verify of
K + 1 rows, acceptance and rollback on the device).
"""
from __future__ import annotations

from kestrel.compiler.frontend import MTP_MLP_LAYER, MTP_PREFIX, ModelConfig
from kestrel.compiler.ir import SCRATCH_PREFIX, TOKENS_STATE, Program
from kestrel.compiler.launch_plan import REPLAY_STATE
from kestrel.compiler.ops import emit
from kestrel.kernels.gated_delta import update_row_width

DYN_SLOTS = (("pos", "i32"), ("token", "i32"), ("sampled", "i32"),
             ("temperature", "f32"), ("top_p", "f32"), ("seed", "i32"), ("n_prompt", "i32"),
             ("top_k", "i32"), ("min_p", "f32"))
SAMPLE_PARTIALS, SAMPLE_TICKET = SCRATCH_PREFIX + "sample_partials", SCRATCH_PREFIX + "sample_ticket"
# the speculative sampler's scratch (spec_filter, draft_sample, spec_sample_rows): sized by select_kernels
SPEC_PARTIALS, SPEC_TICKETS = SCRATCH_PREFIX + "spec_partials", SCRATCH_PREFIX + "spec_tickets"


def plan_weight_name(rel: str) -> str:
    return rel[: -len(".weight")] if rel.endswith(".weight") else rel


GDN_SPLIT_PROJECTIONS = {"in_proj_qkv": ("in_proj_qkvz", (0, 1, 2)), "in_proj_z": ("in_proj_qkvz", (3,)),
                         "in_proj_b": ("in_proj_ba", (0,)), "in_proj_a": ("in_proj_ba", (1,))}


def checkpoint_source(cfg: ModelConfig, rel: str, shape) -> list:
    """The recipe (compiler/weights.py) that makes weight ``rel`` (a Qwen3.5 name, relative to the text
    model) from the checkpoint. Qwen3-Next stores the Gated DeltaNet projections fused and interleaved per
    key-head group (transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering): in_proj_qkvz
    is Hk groups of [q (Dk) | k (Dk) | v (Hv/Hk * Dv) | z (Hv/Hk * Dv)] rows, in_proj_ba Hk groups of
    [b (Hv/Hk) | a (Hv/Hk)]; the Qwen3.5 layout (all q heads, then all k, then all v; z; b; a) is made
    from them. A mixture-of-experts layer's experts (``layers.N.mlp.experts.gate_proj.weight``, ...) are
    stacked from the checkpoint's per-expert tensors, rows of expert e at e * rows."""
    src = ["ckpt", rel]
    parts = rel.split(".")
    if rel.endswith("conv1d.weight"):  # stored [C, 1, K]
        return ["reshape", list(shape), src]
    if cfg.fused_gdn_projections and len(parts) == 5 and parts[2] == "linear_attn" and \
            parts[3] in GDN_SPLIT_PROJECTIONS:
        fused, which = GDN_SPLIT_PROJECTIONS[parts[3]]
        hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        sizes = [dk, dk, r * dv, r * dv] if fused == "in_proj_qkvz" else [r, r]
        return ["groups", hk, sizes, list(which), ["ckpt", ".".join(parts[:3] + [fused, "weight"])]]
    if len(parts) >= 6 and parts[-4:-2] == ["mlp", "experts"]:  # layers.N.mlp.experts.P.weight, mtp.layers.0.mlp...
        return ["experts", ".".join(parts[:-2] + ["*"] + parts[-2:]), cfg.num_experts]
    return src


def lower(cfg: ModelConfig, max_seq: int, kv_dtype: str = "f32", rows: int = 0,
          all_logits: bool = False) -> Program:
    """Build the step program with every weight in its checkpoint layout, declared f32.

    ``rows`` > 0 builds the plan's second program, the M-row step: one replay processes a prompt chunk
    of ``rows`` tokens at positions pos.. (read from the ``tokens`` state; valid while < n_prompt),
    writes the same KV rows, GDN states and conv windows the one-token step reads, takes only the
    chunk's last valid row through the final norm and lm_head, samples at its position (dyn ``last``),
    and ends with ``prefill_end`` (pos past the chunk; after the prompt's last chunk the sampled token
    is appended and fed in). ``all_logits``: every row goes through the final norm and lm_head (outputs
    hidden [rows, H] and logits [rows, V], what verifying drafted tokens needs); the last valid row's
    logits are sampled. Weights, states and dyn slots are declared in the same order as the one-token
    step's, so the two programs share them."""
    p = Program()
    dyn = {name: p.add_dyn(name, dt, host=True) for name, dt in DYN_SLOTS}
    if rows:
        dyn["last"] = p.add_dyn("last", "i32", host=True)
    tokens = p.add_state(TOKENS_STATE, "i32", (max_seq,))

    def weight(rel: str, shape):
        return p.add_weight(plan_weight_name(rel), "f32", shape, checkpoint_source(cfg, rel, shape))

    eps, h_dim = cfg.rms_norm_eps, cfg.hidden_size
    embed = weight("embed_tokens.weight", (cfg.vocab_size, h_dim))
    if rows:
        h = emit(p, "embedding_rows", embed, tokens, dyn["pos"], dyn["n_prompt"], rows=rows)
    else:
        h = emit(p, "embedding", embed, dyn["token"])
    h = _layers(p, cfg, h, weight, dyn, max_seq, kv_dtype, rows, cut_last=bool(rows and not all_logits))
    hidden = emit(p, "rmsnorm", h, weight("norm.weight", (h_dim,)), eps=eps)
    head = embed if cfg.tie_word_embeddings else weight("lm_head.weight", (cfg.vocab_size, h_dim))
    logits = emit(p, "matmul", hidden, head)
    if rows:
        emit(p, "chunk_last", dyn["pos"], dyn["n_prompt"], rows=rows, out=dyn["last"])
    sampled = emit(p, "last_row", logits, dyn["pos"], dyn["n_prompt"]) if rows and all_logits else logits
    # the sampling kernel's per-program partials (one row here: select_kernels gives it the target's
    # program count) and the ticket its last program takes to merge them
    partials = p.add_state(SAMPLE_PARTIALS, "f32", (1, 1))
    ticket = p.add_state(SAMPLE_TICKET, "i32", (1,))
    emit(p, "sample", sampled, dyn["temperature"], dyn["top_p"], dyn["top_k"], dyn["min_p"], dyn["seed"],
         dyn["last" if rows else "pos"], partials, ticket, out=dyn["sampled"])
    if rows:
        emit(p, "prefill_end", dyn["pos"], dyn["sampled"], dyn["n_prompt"], tokens, rows=rows,
             out=[dyn["pos"], dyn["token"]])
    p.outputs["hidden"] = hidden
    p.outputs["logits"] = logits
    return p


def _layers(p: Program, cfg: ModelConfig, h, weight, dyn, max_seq: int, kv_dtype: str, rows: int,
            cut_last: bool = False, snaps: list | None = None):
    """The decoder layers on h (one row, or ``rows`` rows valid while pos + r < dyn["n_prompt"]).
    ``cut_last``: only the last valid row leaves the last layer's MLP (the M-row prefill). ``snaps``: a
    list, when given (the speculative verify), that the Gated DeltaNet layers run with their rows' updates
    kept (``gdn_rows_snap``) and append (rec, rec_rows, conv, conv_snap) to."""
    eps, h_dim = cfg.rms_norm_eps, cfg.hidden_size
    for i, kind in enumerate(cfg.layer_types):
        pre = f"layers.{i}."
        x = emit(p, "rmsnorm", h, weight(pre + "input_layernorm.weight", (h_dim,)), eps=eps)
        if kind == "linear_attention":
            y = _gated_deltanet_rows(p, cfg, pre + "linear_attn.", x, weight, dyn, snaps) if rows else \
                _gated_deltanet(p, cfg, pre + "linear_attn.", x, weight, dyn)
        else:
            y = (_gated_attention_rows if rows else _gated_attention)(p, cfg, pre + "self_attn.", x, weight, dyn,
                                                                      max_seq, kv_dtype)
        h = emit(p, "add", h, y)
        y = _mlp(p, cfg, pre, h, weight)
        if cut_last and i == len(cfg.layer_types) - 1:  # only the last valid row goes on:
            h, y = (emit(p, "last_row", v, dyn["pos"], dyn["n_prompt"]) for v in (h, y))  # the add after it fuses
            # with the final norm
        h = emit(p, "add", h, y)
    return h


def _mlp(p: Program, cfg: ModelConfig, pre: str, h, weight):
    """The MLP of a decoder layer (after its own norm), on the residual stream h; returns its output."""
    h_dim, inter = cfg.hidden_size, cfg.intermediate_size
    x = emit(p, "rmsnorm", h, weight(pre + "post_attention_layernorm.weight", (h_dim,)), eps=cfg.rms_norm_eps)
    if cfg.mlp_type(_mlp_layer(pre)) == "moe":
        return _moe(p, cfg, pre + "mlp.", x, weight)
    gate = emit(p, "matmul", x, weight(pre + "mlp.gate_proj.weight", (inter, h_dim)))
    up = emit(p, "matmul", x, weight(pre + "mlp.up_proj.weight", (inter, h_dim)))
    return emit(p, "matmul", emit(p, "swiglu", gate, up), weight(pre + "mlp.down_proj.weight", (h_dim, inter)))


def _mlp_layer(pre: str) -> int:
    """The layer index whose MLP kind the decoder layer at ``pre`` has: N for ``layers.N.``; for the MTP head's
    ``mtp.layers.0.`` frontend.MTP_MLP_LAYER (vLLM reads the index from the prefix, as here)."""
    return MTP_MLP_LAYER if pre.startswith(MTP_PREFIX) else int(pre.split(".")[1])


def _moe(p: Program, cfg: ModelConfig, pre: str, x, weight):
    """Qwen3-Next's sparse MoE block on x (one row or M rows; kernels/moe.py has the semantics): the router
    writes the layer's routing buffer (expert ids and weights), the experts read it."""
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    ids, wts = emit(p, "moe_router", x, weight(pre + "gate.weight", (e, h)), top_k=cfg.num_experts_per_tok,
                    norm_topk=int(cfg.norm_topk_prob))
    sh = pre + "shared_expert."
    return emit(p, "moe_experts", x, ids, wts, weight(pre + "experts.gate_proj.weight", (e * i, h)),
                weight(pre + "experts.up_proj.weight", (e * i, h)), weight(pre + "experts.down_proj.weight", (e * h, i)),
                weight(sh + "gate_proj.weight", (s, h)), weight(sh + "up_proj.weight", (s, h)),
                weight(sh + "down_proj.weight", (h, s)), weight(pre + "shared_expert_gate.weight", (1, h)))


def _gated_deltanet(p: Program, cfg: ModelConfig, pre: str, x, weight, dyn):
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    c, h_dim, kk = cfg.gdn_conv_channels, cfg.hidden_size, cfg.linear_conv_kernel_dim
    layer = pre.split(".")[1]
    conv_state = p.add_state(f"layers.{layer}.conv_state", "f32", (c, kk - 1))
    rec_state = p.add_state(f"layers.{layer}.recurrent_state", "f32", (hv, dk, dv))

    qkv = emit(p, "matmul", x, weight(pre + "in_proj_qkv.weight", (c, h_dim)))
    z = emit(p, "matmul", x, weight(pre + "in_proj_z.weight", (hv * dv, h_dim)))
    b = emit(p, "matmul", x, weight(pre + "in_proj_b.weight", (hv, h_dim)))
    a = emit(p, "matmul", x, weight(pre + "in_proj_a.weight", (hv, h_dim)))
    mixed = emit(p, "conv1d_step", qkv, conv_state, weight(pre + "conv1d.weight", (c, kk)), act="silu")

    def part(lo, hi, shape):
        return emit(p, "reshape", emit(p, "slice", mixed, axis=0, start=lo, stop=hi), shape=list(shape))

    q = emit(p, "l2norm", part(0, hk * dk, (hk, dk)), eps=1e-6)
    k = emit(p, "l2norm", part(hk * dk, 2 * hk * dk, (hk, dk)), eps=1e-6)
    v = part(2 * hk * dk, c, (hv, dv))
    g, beta = emit(p, "gdn_gates", a, b, weight(pre + "A_log", (hv,)), weight(pre + "dt_bias", (hv,)))
    o = emit(p, "gated_delta_step", q, k, v, g, beta, rec_state, scale=dk ** -0.5)
    o = emit(p, "gated_rmsnorm", o, emit(p, "reshape", z, shape=[hv, dv]), weight(pre + "norm.weight", (dv,)),
               eps=cfg.rms_norm_eps)
    return emit(p, "matmul", emit(p, "reshape", o, shape=[hv * dv]), weight(pre + "out_proj.weight", (h_dim, hv * dv)))


def _kv_caches(p: Program, cfg: ModelConfig, pre: str, max_seq: int, kv_dtype: str):
    """The KV caches of the attention at ``pre`` (``layers.3.self_attn.`` -> ``layers.3.k_cache``; the MTP
    head's ``mtp.layers.0.k_cache``), declared on first use."""
    stem = pre[:-len("self_attn.")]
    shape = (max_seq, cfg.num_key_value_heads, cfg.head_dim)
    return tuple(p.states[n] if n in p.states else p.add_state(n, kv_dtype, shape)
                 for n in (stem + "k_cache", stem + "v_cache"))


def _gated_attention(p: Program, cfg: ModelConfig, pre: str, x, weight, dyn, max_seq: int, kv_dtype: str):
    pos = dyn["pos"]
    nh, nkv, hd, h_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    eps = cfg.rms_norm_eps
    k_cache, v_cache = _kv_caches(p, cfg, pre, max_seq, kv_dtype)

    qg = emit(p, "reshape", emit(p, "matmul", x, weight(pre + "q_proj.weight", (nh * hd * 2, h_dim))),
                shape=[nh, 2 * hd])
    q = emit(p, "slice", qg, axis=1, start=0, stop=hd)
    gate = emit(p, "reshape", emit(p, "slice", qg, axis=1, start=hd, stop=2 * hd), shape=[nh * hd])
    k = emit(p, "reshape", emit(p, "matmul", x, weight(pre + "k_proj.weight", (nkv * hd, h_dim))), shape=[nkv, hd])
    v = emit(p, "reshape", emit(p, "matmul", x, weight(pre + "v_proj.weight", (nkv * hd, h_dim))), shape=[nkv, hd])
    rope = cfg.rope_attrs
    q = emit(p, "rope", emit(p, "rmsnorm", q, weight(pre + "q_norm.weight", (hd,)), eps=eps), pos, **rope)
    k = emit(p, "rope", emit(p, "rmsnorm", k, weight(pre + "k_norm.weight", (hd,)), eps=eps), pos, **rope)
    emit(p, "kv_append", k_cache, v_cache, k, v, pos)
    o = emit(p, "attention", q, k_cache, v_cache, pos, scale=hd ** -0.5)
    o = emit(p, "sigmoid_gate", emit(p, "reshape", o, shape=[nh * hd]), gate)
    return emit(p, "matmul", o, weight(pre + "o_proj.weight", (h_dim, nh * hd)))


def _gated_deltanet_rows(p: Program, cfg: ModelConfig, pre: str, x, weight, dyn, snaps: list | None = None):
    """The Gated DeltaNet layer at M rows: the projections as [M, *] products, the mixer over the chunk
    (gdn_rows; declarations in _gated_deltanet's order). ``snaps`` (the speculative verify): the mixer
    leaves the recurrent state as it was and keeps each row's update and the conv window after each row but
    the last (gdn_rows_snap), and the layer's (rec, rec_rows, conv, conv_snap) is appended for gdn_commit."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    c, h_dim, kk = cfg.gdn_conv_channels, cfg.hidden_size, cfg.linear_conv_kernel_dim
    layer = pre.split(".")[1]
    conv_state = p.add_state(f"layers.{layer}.conv_state", "f32", (c, kk - 1))
    rec_state = p.add_state(f"layers.{layer}.recurrent_state", "f32", (hv, dk, dv))
    rows = x.type.shape[0]

    qkv = emit(p, "matmul", x, weight(pre + "in_proj_qkv.weight", (c, h_dim)))
    z = emit(p, "matmul", x, weight(pre + "in_proj_z.weight", (hv * dv, h_dim)))
    b = emit(p, "matmul", x, weight(pre + "in_proj_b.weight", (hv, h_dim)))
    a = emit(p, "matmul", x, weight(pre + "in_proj_a.weight", (hv, h_dim)))
    mixer = (qkv, b, a, conv_state, weight(pre + "conv1d.weight", (c, kk)), weight(pre + "A_log", (hv,)),
             weight(pre + "dt_bias", (hv,)), rec_state, dyn["pos"], dyn["n_prompt"])
    if snaps is None:
        o = emit(p, "gdn_rows", *mixer, l2_eps=1e-6, scale=dk ** -0.5)
    else:
        width = update_row_width(cfg.linear_num_key_heads, hv, dk, dv)
        rec_rows = p.add_state(f"layers.{layer}.recurrent_rows", "f32", (rows, width))
        conv_snap = p.add_state(f"layers.{layer}.conv_snap", "f32", (rows - 1, c, kk - 1))
        o = emit(p, "gdn_rows_snap", *mixer, rec_rows, conv_snap, l2_eps=1e-6, scale=dk ** -0.5)
        snaps.append((rec_state, rec_rows, conv_state, conv_snap))
    o = emit(p, "gated_rmsnorm", emit(p, "reshape", o, shape=[rows, hv, dv]),
             emit(p, "reshape", z, shape=[rows, hv, dv]), weight(pre + "norm.weight", (dv,)), eps=cfg.rms_norm_eps)
    return emit(p, "matmul", emit(p, "reshape", o, shape=[rows, hv * dv]),
                weight(pre + "out_proj.weight", (h_dim, hv * dv)))


def _gated_attention_rows(p: Program, cfg: ModelConfig, pre: str, x, weight, dyn, max_seq: int, kv_dtype: str):
    """The gated attention layer at M rows (attn_rows; declarations in _gated_attention's order)."""
    nh, nkv, hd, h_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    k_cache, v_cache = _kv_caches(p, cfg, pre, max_seq, kv_dtype)
    qg = emit(p, "matmul", x, weight(pre + "q_proj.weight", (nh * hd * 2, h_dim)))
    k = emit(p, "matmul", x, weight(pre + "k_proj.weight", (nkv * hd, h_dim)))
    v = emit(p, "matmul", x, weight(pre + "v_proj.weight", (nkv * hd, h_dim)))
    o = emit(p, "attn_rows", qg, k, v, weight(pre + "q_norm.weight", (hd,)), weight(pre + "k_norm.weight", (hd,)),
             k_cache, v_cache, dyn["pos"], dyn["n_prompt"], eps=cfg.rms_norm_eps, **cfg.rope_attrs, scale=hd ** -0.5)
    return emit(p, "matmul", o, weight(pre + "o_proj.weight", (h_dim, nh * hd)))


# --- speculative decoding with the model's MTP head (--speculative mtp) -----------------------------------

SPEC_DYN_SLOTS = (("vend", "i32"), ("npos", "i32"), ("dpos", "i32"), ("draft", "i32"), ("accepted", "i32"),
                  ("draft_temperature", "f32"), ("replay", "i32"), ("replay_accept", "f32"))
DRAFT_PROBS, REPLAY = "spec.draft_probs", REPLAY_STATE  # q of each draft [K, V]; the replayed tokens [max_seq]


def lower_speculative(cfg: ModelConfig, max_seq: int, draft_tokens: int, kv_dtype: str = "f32",
                      prefill_rows: int = 0, draft_head: bool = False) -> Program:
    """The two programs of a speculative plan (K = ``draft_tokens`` drafts an iteration, greedy).

    ``prefill_rows`` = 0: **the iteration**, one static program. At entry tokens[pos] is the last
    accepted token and tokens[pos + 1 .. pos + K] the drafts. It verifies the K + 1 rows pos .. pos + K
    in one M-row pass of the model (every row through the final norm and lm_head; the Gated DeltaNet
    layers leave their recurrent states and keep each row's update: gdn_rows_snap), takes each row's greedy
    choice (argmax_rows), accepts on the device (accept: the longest prefix of drafts equal to the
    target's choices plus the target's own next token, a of K accepted), advances every Gated DeltaNet
    layer's state by rows 0 .. a (gdn_commit; KV rows past them are simply written again later),
    then drafts the next K tokens with the MTP head: one pass of the head over the K + 1 verified rows
    (its KV rows for them, with the target's own hidden states: exact for the accepted ones) whose row
    a gives draft 1, then K - 1 one-row passes, each on the previous draft and the head's own hidden
    state; each draft is written after the accepted tokens (draft_end); spec_end leaves pos and token
    where the one-token step would be. Outputs: the verify's hidden [K + 1, H] and logits [K + 1, V].

    ``prefill_rows`` = M: **the speculative prefill**: the M-row step (prompt chunks of M rows, the
    chunk's last valid row sampled as in ``lower``'s), which also runs the MTP head over the chunk's
    rows (its KV rows for the prompt; the token after the prompt's last row is the sampled one) and
    drafts K tokens from the chunk's last valid row; only the prompt's last chunk writes them
    (draft_end never writes a prompt position).

    ``draft_head``: the drafts read their own copy of lm_head (``mtp.draft_head``, the checkpoint's lm_head,
    or the embedding table when tied), which ``--draft-quant`` gives the draft model's precision; without
    it they read the verify's lm_head.

    The weights, states and dyn slots of ``lower``'s programs are declared first, in the same order;
    then the MTP head's weights (``mtp.*``), its KV caches, the rows' updates and snapshots, the new dyn slots."""
    if not 1 <= draft_tokens <= 4:
        raise ValueError(f"draft_tokens {draft_tokens}: 1 to 4")
    verify = prefill_rows == 0
    rows = draft_tokens + 1 if verify else prefill_rows
    p = Program()
    dyn = {name: p.add_dyn(name, dt, host=True) for name, dt in DYN_SLOTS}
    dyn["last"] = p.add_dyn("last", "i32", host=True)
    tokens = p.add_state(TOKENS_STATE, "i32", (max_seq,))

    def weight(rel: str, shape):
        name = plan_weight_name(rel)
        if name in p.weights:  # the MTP head's weights serve its row pass and its one-row drafts
            return p.weights[name]
        return p.add_weight(name, "f32", shape, checkpoint_source(cfg, rel, shape))

    eps, h_dim = cfg.rms_norm_eps, cfg.hidden_size
    embed = weight("embed_tokens.weight", (cfg.vocab_size, h_dim))
    bound = dyn["n_prompt"]
    spec = {name: p.add_dyn(name, dt, host=True) for name, dt in SPEC_DYN_SLOTS}
    q_rows = p.add_state(DRAFT_PROBS, "f32", (draft_tokens, cfg.vocab_size))
    replay = p.add_state(REPLAY, "i32", (max_seq,))
    if verify:
        emit(p, "spec_begin", dyn["pos"], rows=rows, out=spec["vend"])
        emit(p, "replay_drafts", dyn["pos"], spec["replay"], spec["replay_accept"], dyn["seed"], replay, tokens,
             rows=rows, vocab=cfg.vocab_size)
        bound = spec["vend"]
    h = emit(p, "embedding_rows", embed, tokens, dyn["pos"], bound, rows=rows)
    snaps = [] if verify else None
    h = _layers(p, cfg, h, weight, dict(dyn, n_prompt=bound), max_seq, kv_dtype, rows, snaps=snaps)
    for name in (DRAFT_PROBS, REPLAY):  # declared after the layers' states (the step's order comes first)
        p.states[name] = p.states.pop(name)
    hidden_rows = emit(p, "rmsnorm", h, weight("norm.weight", (h_dim,)), eps=eps)
    head = embed if cfg.tie_word_embeddings else weight("lm_head.weight", (cfg.vocab_size, h_dim))
    partials = p.add_state(SAMPLE_PARTIALS, "f32", (1, 1))
    ticket = p.add_state(SAMPLE_TICKET, "i32", (1,))
    spec_part = p.add_state(SPEC_PARTIALS, "f32", (1, 1))
    spec_tickets = p.add_state(SPEC_TICKETS, "i32", (draft_tokens + 1,))
    mtp_kv = (max_seq, kv_dtype)

    if verify:
        logits = emit(p, "matmul", hidden_rows, head)
        targets = emit(p, "argmax_rows", logits)
        emit(p, "spec_filter", logits, dyn["temperature"], dyn["top_p"], dyn["top_k"], dyn["min_p"], spec_part,
             spec_tickets)
        targets = emit(p, "spec_sample_rows", logits, targets, q_rows, tokens, replay, dyn["pos"], dyn["temperature"],
                       dyn["top_p"], dyn["top_k"], dyn["min_p"], dyn["seed"], spec["replay"], spec_part, spec_tickets)
        emit(p, "accept", targets, dyn["pos"], tokens, out=[spec["npos"], spec["dpos"], dyn["sampled"],
                                                              spec["accepted"]])
        for rec, rec_rows, conv, conv_snap in snaps:
            emit(p, "gdn_commit", rec, rec_rows, conv, conv_snap, dyn["pos"], spec["npos"])
        hidden, row_end = hidden_rows, spec["npos"]  # the draft chain starts at the last accepted row
    else:
        hidden = emit(p, "last_row", hidden_rows, dyn["pos"], bound)
        logits = emit(p, "matmul", hidden, head)
        emit(p, "chunk_last", dyn["pos"], dyn["n_prompt"], rows=rows, out=dyn["last"])
        emit(p, "sample", logits, dyn["temperature"], dyn["top_p"], dyn["top_k"], dyn["min_p"], dyn["seed"],
             dyn["last"], partials, ticket, out=dyn["sampled"])
        emit(p, "chunk_last", dyn["pos"], dyn["n_prompt"], rows=rows, out=spec["dpos"])
        row_end = bound  # the draft chain starts at the chunk's last valid row

    def draft(logits_row, j):  # the greedy draft, then at temperature > 0 a draw from q (kept as q_rows[j])
        emit(p, "sample", logits_row, spec["draft_temperature"], dyn["top_p"], dyn["top_k"], dyn["min_p"],
             dyn["seed"], spec["dpos"], partials, ticket, out=spec["draft"])
        emit(p, "spec_filter", logits_row, dyn["temperature"], dyn["top_p"], dyn["top_k"], dyn["min_p"], spec_part,
             spec_tickets)
        emit(p, "draft_sample", logits_row, spec["draft"], dyn["temperature"], dyn["top_p"], dyn["top_k"],
             dyn["min_p"], dyn["seed"], spec["dpos"], q_rows, spec_part, spec_tickets, row=j, out=spec["draft"])
        emit(p, "draft_end", spec["dpos"], spec["draft"], dyn["n_prompt"], tokens, out=spec["dpos"])

    # draft 1: the MTP head over the rows (the token after each row, the model's hidden state there)
    e = emit(p, "embedding_next_rows", embed, tokens, dyn["pos"], bound, dyn["sampled"], rows=rows)
    m = _mtp_head(p, cfg, e, hidden_rows, weight, {"pos": dyn["pos"], "n_prompt": bound}, True, *mtp_kv)
    m = emit(p, "last_row", m, dyn["pos"], row_end)
    if draft_head:
        head = weight("mtp.draft_head", (cfg.vocab_size, h_dim))
        head.source = ["ckpt", "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    draft(emit(p, "matmul", m, head), 0)
    for j in range(1, draft_tokens):  # drafts 2..K: the previous draft and the head's own hidden state
        e = emit(p, "embedding", embed, spec["draft"])
        m = _mtp_head(p, cfg, e, m, weight, {"pos": spec["dpos"]}, False, *mtp_kv)
        draft(emit(p, "matmul", m, head), j)
    if verify:
        emit(p, "spec_end", spec["npos"], dyn["sampled"], out=[dyn["pos"], dyn["token"]])
        p.outputs["hidden"], p.outputs["logits"] = hidden_rows, logits
    else:
        emit(p, "prefill_end", dyn["pos"], dyn["sampled"], dyn["n_prompt"], tokens, rows=rows,
             out=[dyn["pos"], dyn["token"]])
        p.outputs["hidden"], p.outputs["logits"] = hidden, logits
    return p


def _mtp_head(p: Program, cfg: ModelConfig, e, hidden, weight, dyn, rows: bool, max_seq: int, kv_dtype: str):
    """The MTP head (kernels/mtp.py, ``mtp_forward_ref``, has the semantics and the vLLM source it follows)
    on token embeddings e and hidden states (one row, or rows valid while pos + r < dyn["n_prompt"]),
    its attention at dyn["pos"] (+ r) on its own KV caches; returns its final-normed hidden state."""
    eps, h_dim = cfg.rms_norm_eps, cfg.hidden_size
    en = emit(p, "rmsnorm", e, weight("mtp.pre_fc_norm_embedding.weight", (h_dim,)), eps=eps)
    hn = emit(p, "rmsnorm", hidden, weight("mtp.pre_fc_norm_hidden.weight", (h_dim,)), eps=eps)
    u = emit(p, "matmul", emit(p, "concat", en, hn), weight("mtp.fc.weight", (h_dim, 2 * h_dim)))
    pre = "mtp.layers.0."
    x = emit(p, "rmsnorm", u, weight(pre + "input_layernorm.weight", (h_dim,)), eps=eps)
    y = (_gated_attention_rows if rows else _gated_attention)(p, cfg, pre + "self_attn.", x, weight, dyn, max_seq,
                                                              kv_dtype)
    u = emit(p, "add", u, y)
    u = emit(p, "add", u, _mlp(p, cfg, pre, u, weight))
    return emit(p, "rmsnorm", u, weight("mtp.norm.weight", (h_dim,)), eps=eps)
