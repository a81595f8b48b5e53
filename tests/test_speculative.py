"""Speculative decoding with the model's MTP head (kestrelc build --speculative mtp) on the CPU path:
greedy speculative output equals plain greedy output token for token —

  * on a transformers-made checkpoint given an MTP head (the oracle: transformers' own greedy tokens),
    whose compiled drafts also equal an independent torch MTP forward (kernels/mtp.py) fed with
    transformers' final-normed hidden states;
  * on the random-weight tiny-mtp preset (checkpoint and --weights random), where drafts are nearly
    always rejected, so the rollback runs at almost every iteration: the recurrent states, conv windows,
    KV rows and token sequence after the speculative run are bit-identical to a plain run's at the
    same position;
  * on a small model whose MTP head is trained here (on a repetitive sequence), so that drafts are
    mostly accepted: its acceptance rate is reported and must be high;

and the build's errors: no MTP head (exit 11), bad --draft-tokens.
"""
import json
import os

import pytest
import torch

from conftest import run_cli
from hf_checkpoints import add_mtp_head, hf_greedy, make_next_checkpoint, make_text_checkpoint
from kestrel.artifacts.errors import InputError, NoDraftHeadError
from kestrel.artifacts.plan import load_plan
from kestrel.compiler.build import build
from kestrel.compiler.launch_plan import SPEC_ROW_STATES
from kestrel.compiler.frontend import read_config
from kestrel.kernels.mtp import mtp_dims, mtp_forward_ref
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.generate import SamplingParams, generate

PROMPT = [5, 17, 42, 99, 3, 150, 7]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Torch on one thread here: these tiny models run and train as fast, deterministically, and without
    the stalls two OpenMP threads suffer on a 2-core machine that something else keeps busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _steps(plan_path):
    """(speculative CpuStep, the same plan's plain CpuStep: speculation off)."""
    plan = load_plan(plan_path)
    spec, plain = CpuStep(plan), CpuStep(plan)
    plan.close()
    plain.spec_k = 0
    return spec, plain


def _build(model, path, k, **kw):
    build(model, str(path), log=lambda m: None, progress=False, speculative="mtp", draft_tokens=k, **kw)
    return str(path)


def _with_head(d, make):
    """(transformers model, checkpoint folder, its MTP head's tensors, d): ``make(folder)`` saves the model in
    d/ckpt, then an MTP head is added."""
    ckpt = str(d / "ckpt")
    model = make(ckpt)
    return model, ckpt, add_mtp_head(ckpt, seed=3), d


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return _with_head(tmp_path_factory.mktemp("oracle"), lambda f: make_text_checkpoint(f, "base"))


@pytest.mark.parametrize("k", [3, 1])
def test_oracle_checkpoint_speculative_equals_transformers_greedy(oracle, k):
    model, ckpt, _, d = oracle
    hf_tokens, _ = hf_greedy(model, PROMPT, 24)
    spec, plain = _steps(_build(ckpt, d / f"k{k}.plan", k, max_seq=64, prefill_rows=4))  # two prefill chunks
    g = generate(spec, PROMPT, 24, SamplingParams())
    assert g.tokens == hf_tokens == generate(plain, PROMPT, 24, SamplingParams()).tokens
    assert g.draft_tokens == k and g.spec_iterations >= 24 // (k + 1)
    print(f"K={k}: {g.spec_iterations} iterations, {g.accepted_per_step:.2f} drafts accepted per iteration")


@pytest.fixture(scope="module")
def next_oracle(tmp_path_factory):
    """A Qwen3-Next checkpoint saved by transformers (8 experts, top 2) given an MTP head (its layer a MoE block)."""
    return _with_head(tmp_path_factory.mktemp("next_oracle"), lambda f: make_next_checkpoint(f, "e8k2"))


@pytest.mark.parametrize("which", ["oracle", "next_oracle"])
def test_compiled_drafts_equal_the_torch_mtp_forward(which, request):
    """After the speculative prefill, tokens[n + 1 .. n + K] are the head's drafts: compare them with
    ``mtp_forward_ref`` run over the prompt's rows (transformers' final-normed hidden states h_t and
    the tokens x_{t+1}, at positions t), then chained on its own hidden state and drafts. next_oracle: a
    Qwen3-Next model and head (MoE), the speculative output also equal to transformers' greedy tokens."""
    model, ckpt, head, d = request.getfixturevalue(which)
    k, n = 3, len(PROMPT)
    spec, _ = _steps(_build(ckpt, d / "drafts.plan", k, max_seq=64))
    spec.begin(PROMPT, 0.0, 1.0, 0)
    spec.run_spec_prefill(1)
    seq = [int(t) for t in spec.states["tokens"][:n + 1 + k]]
    with torch.no_grad():
        out = model.model(torch.tensor([PROMPT])).last_hidden_state[0]  # after the final norm
        assert torch.allclose(model.lm_head(out)[-1], model(torch.tensor([PROMPT])).logits[0, -1], atol=1e-5)
        assert seq[n] == int(model.lm_head(out)[-1].argmax())
        embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
        w = {name[len("mtp."):]: t for name, t in head.items()}
        dims = mtp_dims(read_config(ckpt)[1])
        nxt = torch.tensor(PROMPT[1:] + [seq[n]])
        m, past = mtp_forward_ref(w, embed[nxt], out, torch.arange(n), **dims)
        drafts, h, pos = [], m[-1:], n - 1
        for _ in range(k):
            drafts.append(int((h[0] @ lm_head.T).argmax()))
            pos += 1
            h, past = mtp_forward_ref(w, embed[torch.tensor(drafts[-1:])], h, torch.tensor([pos]), past=past, **dims)
    assert seq[n + 1:] == drafts
    if which == "next_oracle":
        hf_tokens, _ = hf_greedy(model, PROMPT, 16)
        spec.reset()
        assert generate(spec, PROMPT, 16, SamplingParams()).tokens == hf_tokens


@pytest.mark.parametrize("norm_topk,yarn", [(True, False), (False, False), (True, True)],
                         ids=["norm", "nonorm", "yarn"])
def test_qwen3_next_mtp_reference_equals_transformers_decoder_layer(norm_topk, yarn):
    """``mtp_forward_ref`` on a Qwen3-Next head (the layer's MLP a sparse MoE block) against an independent
    computation: transformers' Qwen3NextDecoderLayer (full attention, MoE; eager attention with a causal mask)
    loaded with the head's layer (experts fused as transformers holds them), between transformers'
    Qwen3NextRMSNorm pre-fc norms, the fc product and the final norm, within 1e-4 relative over 6 rows;
    the ref's ``past`` path too (4 rows, then 2 on their keys and values); ``yarn``: the head's attention with YaRN
    (hf_checkpoints' e8k2_yarn RoPE), as transformers' rotary embedding makes it."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextDecoderLayer, Qwen3NextRMSNorm,
                                                                    Qwen3NextRotaryEmbedding)

    from hf_checkpoints import NEXT_BASE, NEXT_CONFIGS
    from kestrel.compiler.frontend import mtp_expected_tensors, parse_config
    from kestrel.compiler.presets import random_weights

    raw = dict(NEXT_BASE, model_type="qwen3_next", norm_topk_prob=norm_topk,
               **(NEXT_CONFIGS["e8k2_yarn"][0] if yarn else {}))
    cfg = parse_config(raw)
    assert bool(cfg.rope_yarn) == yarn
    w = {k[len("mtp."):]: torch.from_numpy(v) for k, v in random_weights(dict(mtp_expected_tensors(cfg)), 3).items()}
    hf = Qwen3NextConfig(**dict(raw, num_hidden_layers=1, layer_types=["full_attention"]))
    hf._attn_implementation = "eager"
    layer = Qwen3NextDecoderLayer(hf, 0).eval()
    assert type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock"
    p, e = "layers.0.", range(cfg.num_experts)
    sd = {k[len(p):]: v for k, v in w.items() if k.startswith(p) and ".experts." not in k}
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"{p}mlp.experts.{i}.gate_proj.weight"],
                                                             w[f"{p}mlp.experts.{i}.up_proj.weight"]]) for i in e])
    sd["mlp.experts.down_proj"] = torch.stack([w[f"{p}mlp.experts.{i}.down_proj.weight"] for i in e])
    layer.load_state_dict(sd, strict=True)

    def norm(x, name):
        n = Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n.weight.data = w[name]
        return n(x)

    t, gen = 6, torch.Generator().manual_seed(0)
    emb, hidden = torch.randn(t, cfg.hidden_size, generator=gen), torch.randn(t, cfg.hidden_size, generator=gen)
    pos = torch.arange(5, 5 + t)
    with torch.no_grad():
        u = torch.cat([norm(emb, "pre_fc_norm_embedding.weight"), norm(hidden, "pre_fc_norm_hidden.weight")], -1) @ \
            w["fc.weight"].T
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(u[None], position_embeddings=Qwen3NextRotaryEmbedding(hf)(u[None], pos[None]),
                    attention_mask=causal, position_ids=pos[None])
        want = norm(out[0], "norm.weight")
        got, _ = mtp_forward_ref(w, emb, hidden, pos, **mtp_dims(cfg))
        first, past = mtp_forward_ref(w, emb[:4], hidden[:4], pos[:4], **mtp_dims(cfg))
        rest, _ = mtp_forward_ref(w, emb[4:], hidden[4:], pos[4:], past=past, **mtp_dims(cfg))
    for what, g in (("one pass", got), ("4 rows, then 2 on their past", torch.cat([first, rest]))):
        rel = ((g - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-4, f"{what}: {rel:.2e}"


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_mtp")
    return _build("tiny-mtp", d / "k3.plan", 3, max_seq=96, prefill_rows=8), d


def _states(step, names):
    return {n: step.states[n].clone() for n in names}


@pytest.mark.parametrize("preset,weights", [("tiny-mtp", "checkpoint"), ("tiny-mtp", "random"),
                                            ("tiny-next-mtp", "random"), ("tiny-moe-mtp", "random")])
def test_random_weights_rollback_every_iteration_states_bit_identical(tiny_mtp, preset, weights):
    """Random drafts are rejected: every iteration rolls its Gated DeltaNet layers back. After the
    speculative run, every state equals a plain run's at the same position, bit for bit. tiny-next-mtp:
    Qwen3-Next (fused GDN projections, MoE blocks; the head's layer a MoE block) with K = 3, the prompt
    in M-row chunks of 16 (its MoE grouped by expert; the head's over the chunk too) and 8; tiny-moe-mtp: the
    same with Qwen3.5 MoE's layers (unfused GDN projections, a MoE block in every layer and the head's)."""
    path, d = tiny_mtp
    if preset in ("tiny-next-mtp", "tiny-moe-mtp"):
        path = _build(preset, d / f"{preset}.plan", 3, max_seq=96, prefill_rows=16, weights="random", seed=3)
    elif weights == "random":
        path = _build("tiny-mtp", d / "random.plan", 2, max_seq=96, prefill_rows=8, weights="random", seed=7)
    spec, plain = _steps(path)
    prompt = list(b"Speculate, then roll back.")
    g = generate(spec, prompt, 40, SamplingParams())
    p = generate(plain, prompt, 40, SamplingParams())
    assert g.tokens == p.tokens and len(set(g.tokens)) > 5
    assert g.spec_iterations >= 20 and g.accepted_per_step < 0.5  # mostly rejected: rollback nearly every time
    # states at the speculative run's final position against a plain run that ends there
    pos = int(spec.dyn["pos"])
    plain.reset()
    generate(plain, prompt, pos - len(prompt) + 1, SamplingParams())
    assert int(plain.dyn["pos"]) == pos and int(plain.dyn["token"]) == int(spec.dyn["token"])
    for name, s in plain.states.items():
        if name.endswith(SPEC_ROW_STATES) or name.startswith(("mtp.", "scratch.")):
            continue  # the speculative programs' own (the verify's row states, the head's KV caches)
        got = spec.states[name]
        if name.endswith(("k_cache", "v_cache")):
            s, got = s[:pos], got[:pos]  # rows past pos are written again before they are read
        elif name == "tokens":
            s, got = s[:pos + 1], got[:pos + 1]
        assert torch.equal(got, s), name


def test_speculative_prefill_near_max_seq_and_plain_fallback(tiny_mtp):
    """Close to max_seq no iteration fits (an iteration at p writes up to p + 2K + 1): the run finishes
    with plain steps, still equal to plain decoding, and never writes outside the sequence."""
    path, _ = tiny_mtp
    spec, plain = _steps(path)
    prompt = list(range(30, 30 + 80))  # 80 + 16 = max_seq 96
    g = generate(spec, prompt, 16, SamplingParams())
    assert g.tokens == generate(plain, prompt, 16, SamplingParams()).tokens
    assert 0 < g.spec_iterations < 16


def test_kestrel_run_json_reports_acceptance(tiny_mtp):
    path, _ = tiny_mtp
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    r = run_cli("kestrel-run", path, "--prompt", "Hello", "--max-new-tokens", "12", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["draft_tokens"] == 3 and 0 <= out["accepted_per_step"] <= 3 and out["speculative_iterations"] > 0
    sampled = json.loads(run_cli("kestrel-run", path, "--prompt", "Hello", "--max-new-tokens", "4", "--json",
                                 "--temperature", "0.7", env=env).stdout)
    assert sampled["draft_tokens"] == 3 and sampled["speculative_iterations"] > 0  # sampling speculates too


def test_multimodal_layout_with_a_head(tmp_path):
    """The multimodal wrapper's layout (model.language_model.*, the head at mtp.*): speculative output
    equals transformers' greedy tokens; a head missing a tensor is refused naming it (exit 4's error)."""
    from kestrel.artifacts.errors import CheckpointError
    from hf_checkpoints import make_multimodal_checkpoint

    ckpt = str(tmp_path / "mm")
    model = make_multimodal_checkpoint(ckpt)  # carries a lone mtp.fc.weight: an incomplete head
    with pytest.raises(CheckpointError, match="missing tensor 'mtp.pre_fc_norm_embedding.weight'"):
        build(ckpt, str(tmp_path / "x.plan"), log=lambda m: None, progress=False, speculative="mtp")
    add_mtp_head(ckpt, seed=5)
    spec, _ = _steps(_build(ckpt, tmp_path / "mm.plan", 2, max_seq=64))
    hf_tokens, _ = hf_greedy(model, PROMPT, 12)
    assert generate(spec, PROMPT, 12, SamplingParams()).tokens == hf_tokens


def test_sm90_speculative_plan_is_built_with_the_exact_verify_rules(tmp_path):
    """A speculative GPU plan is built with exact_verify_rules (each verified row the one-token step's bit for bit),
    for that build only: the twin kernels without FMA contraction, the verify's attention in step order; a plain
    plan built after it keeps the target's own rules."""
    from kestrel.artifacts.plan import load_plan
    from kestrel.kernels.targets import TARGETS

    before = TARGETS["sm_90"]
    lines = []
    build("tiny-mtp", str(tmp_path / "s.plan"), log=lines.append, progress=False, speculative="mtp", draft_tokens=3,
          target="sm_90", quant="q4")
    assert TARGETS["sm_90"] is before
    assert any("attn_rows.step_order_rows=4" in x and "gdn_delta.fp_fusion=False" in x for x in lines), lines
    lp = load_plan(str(tmp_path / "s.plan")).launch_plan
    ids = [k["id"] for k in lp["kernels"]]
    assert {k["id"] for k in lp["kernels"] if k.get("fp_fusion") is False} == {
        "gdn_delta", "gdn_norm", "gdn_rows_delta_snap", "gdn_rows_norm_snap", "gdn_commit", "attn_step_bf16",
        "attn_rows_step_bf16", "attn_rows_kv_bf16"}
    assert {ids[x["kernel_index"]] for x in lp["speculative"]["iteration"]["launches"] if x["op"] == "attn_rows_q"} \
        == {"attn_rows_step_bf16"}
    build("tiny-mtp", str(tmp_path / "p.plan"), log=lambda m: None, progress=False, target="sm_90", quant="q4")
    assert not any("fp_fusion" in k for k in load_plan(str(tmp_path / "p.plan")).launch_plan["kernels"])
    # bf16: the one-token step's norms unfolded from its products, as the verify's few-rows matvec runs its rows
    # (fuse folds them: a plain plan keeps them folded)
    from kestrel.compiler.ir_text import parse_program

    def kinds(name, **kw):
        build("tiny-mtp", str(tmp_path / name), log=lambda m: None, progress=False, target="sm_90", quant="bf16", **kw)
        return [op.kind for op in parse_program(load_plan(str(tmp_path / name)).program_text).ops]
    spec, plain = kinds("sb.plan", speculative="mtp", draft_tokens=2), kinds("pb.plan")
    assert "matmul_add" in plain and "rmsnorm_matmul_swiglu" in plain
    assert not {"matmul_add", "rmsnorm_matmul", "rmsnorm_matmul_swiglu"} & set(spec)
    assert spec.count("add_rmsnorm") == plain.count("matmul_add") + plain.count("add_rmsnorm")
    # and its bf16 products, one row and few rows, as explicit FMA pairs (matvec_rows.pair_fma), contraction left on
    ks = load_plan(str(tmp_path / "sb.plan")).launch_plan["kernels"]
    pair = {k["id"] for k in ks if k["constexprs"].get("PAIR_FMA")}
    assert {"matvec_bf16", "matvec_rows_bf16"} <= pair, pair
    assert not any(k.get("fp_fusion") is False for k in ks if k["id"].startswith("matvec")), ks
    plain_ks = load_plan(str(tmp_path / "pb.plan")).launch_plan["kernels"]
    assert not any("fp_fusion" in k or k["constexprs"].get("PAIR_FMA") for k in plain_ks)


def test_sm90_speculative_qwen3_next_step_runs_the_verify_rows_moe_chains(tmp_path):
    """Qwen3-Next (q4, sm_90): the verify's rows run the residual add, the norm, the router and the MoE block
    unfolded (the MoE kernels have no folded rows form), so a speculative plan's one-token step runs them so too
    (exact_verify_rules: each verified row the step's bit for bit): per weight, the ops that read the layers'
    norms, routers and experts are of the same kinds in both programs, where a plain plan folds them into the
    products (matmul_add, moe_down_add, rmsnorm_matmul, rmsnorm_moe_gate_up). The q4 chains the tensor-core
    kernel folds at the verify's rows (the attention layer's dense MLP) stay folded in both."""
    from kestrel.compiler.ir import Weight
    from kestrel.compiler.ir_text import parse_program

    def ops(name, **kw):
        build("tiny-next-mtp", str(tmp_path / name), log=lambda m: None, progress=False, target="sm_90", quant="q4",
              **kw)
        plan = load_plan(str(tmp_path / name))
        return plan, [op for op in parse_program(plan.program_text).ops]

    def by_weight(program_ops, rows: int):
        """{weight name: [kinds of the ops at ``rows`` rows reading it]} for the model's layers (not the head's)."""
        out = {}
        for op in program_ops:
            if op.kind == "embedding_rmsnorm":  # one row's gather with the first norm after it (fuse rule 4): that
                if rows == 1:                    # norm is the rmsnorm the verify's rows run after their gather
                    out.setdefault(op.ins[2].name, []).append("rmsnorm")
                continue
            shape = op.ins[0].type.shape if op.ins and hasattr(op.ins[0], "type") else ()
            if len(shape) != (1 if rows == 1 else 2) or (rows > 1 and shape[0] != rows):
                continue
            for w in op.ins:
                if isinstance(w, Weight) and w.name.startswith("layers.") and (".mlp." in w.name or "layernorm" in w.name):
                    out.setdefault(w.name, []).append(op.kind)
        return out

    spec_plan, spec = ops("s.plan", speculative="mtp", draft_tokens=3)
    _, plain = ops("p.plan")
    verify = parse_program(spec_plan.spec_programs[1]).ops
    folded = {"matmul_add", "moe_down_add", "rmsnorm_moe_gate_up"}
    assert folded <= {op.kind for op in plain}
    step_kinds, verify_kinds = by_weight(spec, 1), by_weight(verify, 4)
    assert step_kinds and step_kinds == verify_kinds, (step_kinds, verify_kinds)
    assert not {"moe_down_add", "rmsnorm_moe_gate_up"} & {k for ks in step_kinds.values() for k in ks}
    assert any(k in ("matmul_add", "rmsnorm_matmul_swiglu") for ks in step_kinds.values() for k in ks) == any(
        k in ("matmul_add", "rmsnorm_matmul_swiglu") for ks in verify_kinds.values() for k in ks)


def test_build_errors(tmp_path):
    with pytest.raises(NoDraftHeadError, match="no mtp.* tensors"):
        build("tiny", str(tmp_path / "a.plan"), log=lambda m: None, progress=False, speculative="mtp")
    with pytest.raises(NoDraftHeadError, match="names none"):
        build("tiny", str(tmp_path / "a.plan"), log=lambda m: None, progress=False, speculative="mtp",
              weights="random")
    with pytest.raises(InputError, match="--draft-tokens 5"):
        build("tiny-mtp", str(tmp_path / "a.plan"), speculative="mtp", draft_tokens=5)
    with pytest.raises(InputError, match="--draft-tokens goes with"):
        build("tiny-mtp", str(tmp_path / "a.plan"), draft_tokens=2)
    with pytest.raises(InputError, match="--prefill-rows"):
        build("tiny-mtp", str(tmp_path / "a.plan"), speculative="mtp", prefill_rows=0)
    with pytest.raises(InputError, match="--draft-quant goes with"):
        build("tiny-mtp", str(tmp_path / "a.plan"), draft_quant="q4")
    r = run_cli("kestrelc", "build", "tiny", "--speculative", "mtp", "-o", str(tmp_path / "b.plan"))
    assert r.returncode == 11 and r.stderr.count("\n") <= 2 and r.stderr.splitlines()[-1].startswith("error:")
    assert "preset tiny" in r.stderr and "build without --speculative" in r.stderr
    assert not os.path.exists(tmp_path / "a.plan") and not os.path.exists(tmp_path / "b.plan")


# --- a model whose MTP head is trained here, so that drafts are mostly accepted ----------------------

TRAIN = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None,
             pad_token_id=None, bos_token_id=None)
# the same as Qwen3-Next: fused GDN projections, a sparse MoE block in both layers and in the MTP head's layer
TRAIN_NEXT = dict(TRAIN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1)
PERIOD = [int(t) for t in torch.randperm(48, generator=torch.Generator().manual_seed(5))[:23]]


def _train_model_with_mtp(folder: str, steps: int = 80, mtp_steps: int = 120, seed: int = 0,
                          model_type: str = "qwen3_5_text"):
    """A Qwen3.5 model (transformers; ``model_type`` qwen3_next: a Qwen3-Next model of TRAIN_NEXT) trained on a
    repeating 23-token sequence, then its MTP head trained (the model frozen) with ``mtp_forward_ref`` to
    predict x_{t+2} from x_{t+1} and the model's final-normed h_t; saved as a checkpoint with the head.
    Returns the head's final training loss."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    from kestrel.compiler.frontend import mtp_expected_tensors, parse_config
    from kestrel.compiler.presets import random_weights
    from kestrel.kernels.mtp import mtp_dims

    torch.manual_seed(seed)
    data = torch.tensor(PERIOD * 12)
    gen = torch.Generator().manual_seed(seed)

    def batch():
        return torch.stack([data[i:i + 49] for i in torch.randint(0, len(data) - 49, (8,), generator=gen)])

    raw = TRAIN_NEXT if model_type == "qwen3_next" else TRAIN
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**raw)) if model_type == "qwen3_next" else \
        Qwen3_5ForCausalLM(Qwen3_5TextConfig(**raw))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        b = batch()
        model(input_ids=b, labels=b).loss.backward()  # (transformers shifts the labels itself)
        opt.step()
        opt.zero_grad()
    model.eval()
    cfg = parse_config(dict(raw, model_type=model_type), "train")
    head = {k: torch.nn.Parameter(torch.from_numpy(v))
            for k, v in random_weights(dict(mtp_expected_tensors(cfg)), seed + 1).items()}
    w = {k[len("mtp."):]: v for k, v in head.items()}
    opt = torch.optim.AdamW(head.values(), lr=3e-3)
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    seq = data[:120]
    with torch.no_grad():  # the model is frozen: its final-normed h_t over the sequence, once
        h = model.model(seq[None]).last_hidden_state[0]
    for _ in range(mtp_steps):  # the head over the whole sequence, as vLLM's proposer runs it after a prefill
        m, _ = mtp_forward_ref(w, embed[seq[1:-1]], h[:-2], torch.arange(len(seq) - 2), **mtp_dims(cfg))
        loss = torch.nn.functional.cross_entropy(m @ lm_head.T, seq[2:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)
    add_mtp_head(folder, tensors={k: v.detach() for k, v in head.items()})
    return float(loss.detach())


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_trained_mtp_head_drafts_are_mostly_accepted_and_output_is_exact(tmp_path, model_type):
    """The trained head's drafts are (nearly) all accepted; the same head with noise added to its
    matrices (the first of 1.5, 1.25, 1.75, 2 standard deviations that does it) is accepted 0, 1, 2 and
    3 times across iterations, so the rollback returns to every verified row; the output equals plain
    decoding's throughout. qwen3_next: the same with Qwen3-Next's fused GDN projections and MoE blocks, the
    head's layer a MoE block too (measured: 3.00 of 3 drafts accepted per iteration, as Qwen3.5's; with q4 drafts
    3.00; its head with noise of 1 sd 1.95 of 3, iterations accepting 0 / 1 / 2 / 3 drafts: 3 / 6 / 6 / 9)."""
    from safetensors.torch import load_file

    ckpt = str(tmp_path / "ckpt")
    steps = {"steps": 50, "mtp_steps": 60} if model_type == "qwen3_next" else {}  # (as many drafts accepted)
    mtp_loss = _train_model_with_mtp(ckpt, model_type=model_type, **steps)
    prompt = PERIOD[3:] + PERIOD[:5]  # 25 tokens: the sequence from its 4th token on
    spec, plain = _steps(_build(ckpt, tmp_path / "k3.plan", 3, max_seq=128, prefill_rows=16))
    g = generate(spec, prompt, 60, SamplingParams())
    want = generate(plain, prompt, 60, SamplingParams()).tokens
    assert g.tokens == want and want[:23] == (PERIOD[5:] + PERIOD)[:23]  # the model learnt the sequence
    rate = g.accepted_per_step / g.draft_tokens
    print(f"trained MTP head (training loss {mtp_loss:.3f}): {g.accepted_per_step:.2f} of {g.draft_tokens} drafts "
          f"accepted per iteration ({rate:.0%}) over {g.spec_iterations} iterations for {len(g.tokens)} tokens")
    assert g.accepted_per_step >= 2.0 and g.spec_iterations <= 60 // 3, \
        f"{g.accepted_per_step:.2f} of 3 drafts accepted over {g.spec_iterations} iterations"
    # the draft model in q4 (--draft-quant q4: the MTP head's matrices and its own lm_head copy): the same
    # output; how many drafts it gets accepted is reported, and stays high
    path = _build(ckpt, tmp_path / "k3-q4drafts.plan", 3, max_seq=128, prefill_rows=16, quant="bf16",
                  draft_quant="q4")
    dtypes = {line.split()[1]: line.split()[3].split("[")[0] for line in load_plan(path).spec_programs[1].splitlines()
              if line.startswith("weight ")}
    assert dtypes["mtp.draft_head"].startswith("q4") and dtypes["mtp.fc"].startswith("q4")
    assert dtypes["lm_head"] == "bf16" and not any(d.startswith("q4") for n, d in dtypes.items() if "mtp." not in n)
    spec4, plain4 = _steps(path)
    g4 = generate(spec4, prompt, 60, SamplingParams())
    assert g4.tokens == generate(plain4, prompt, 60, SamplingParams()).tokens
    print(f"trained MTP head, drafts in q4 (model bf16): {g4.accepted_per_step:.2f} of 3 drafts accepted per "
          f"iteration over {g4.spec_iterations} iterations")
    assert g4.accepted_per_step >= 2.0, f"q4 drafts: {g4.accepted_per_step:.2f} of 3 accepted"
    head = {k: v for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items() if k.startswith("mtp.")}
    # (Qwen3-Next's head, whose router noise also changes the experts, needs less: 1.5 sd left 0 of 3 iterations
    # accepting all 3 drafts)
    for sigma in (1.5, 1.25, 1.75, 2.0) if model_type == "qwen3_5_text" else (1.0, 1.1, 0.9):
        gen = torch.Generator().manual_seed(1)
        add_mtp_head(ckpt, tensors={k: v + sigma * v.std() * torch.randn(v.shape, generator=gen) if v.dim() == 2
                                    else v for k, v in head.items()})
        spec, _ = _steps(_build(ckpt, tmp_path / f"noisy{sigma}.plan", 3, max_seq=128, prefill_rows=16))
        g = generate(spec, prompt, 60, SamplingParams())
        assert g.tokens == want
        counts = {a: spec.accepted_log.count(a) for a in range(4)}
        print(f"noisy MTP head ({sigma} sd): {g.accepted_per_step:.2f} of 3 drafts accepted per iteration; "
              f"iterations by drafts accepted: {counts}")
        if all(counts.values()):
            break
    assert all(counts.values()), f"iterations by drafts accepted: {counts}"


# --- the token loop's speculative read-back, on a scripted step (what the GPU runtime will drive) ----------

def _truth(i: int) -> int:
    return (3 * i + 1) % 97


class ScriptedSpecStep:
    """The step protocol of runtime/generate.py with asynchronous semantics: iterations accept drafts as
    ``script`` says (writing the true tokens, then garbage drafts after them), read-backs are snapshots
    taken when enqueued (stream order) and handed over only at ``wait()``; ``events`` records the order."""

    synchronous = False
    mode = "scripted"

    def __init__(self, max_seq: int, k: int, script, prefill_rows: int = 4):
        self.max_seq, self.spec_k, self.prefill_rows = max_seq, k, prefill_rows
        self.script, self.events, self.inflight, self.most_inflight = iter(script), [], 0, 0
        self.tokens, self.pos, self.dyn = [-9] * max_seq, 0, {}

    def begin(self, prompt, temperature, top_p, seed, start=0, top_k=0, min_p=0.0):
        self.tokens[:len(prompt)] = prompt
        self.n = len(prompt)

    def run_spec_prefill(self, n, marks=None):
        self.pos, self.tokens[self.n] = self.n, _truth(self.n)
        self.events.append("prefill")

    def run_spec(self, n, marks=None):
        k = self.spec_k
        for _ in range(n):
            assert self.pos + 2 * k + 1 <= self.max_seq - 1, "an iteration that does not fit"
            a = next(self.script)
            for i in range(1, a + 2):
                self.tokens[self.pos + i] = _truth(self.pos + i)
            for i in range(a + 2, a + 2 + k):  # the next drafts: not tokens yet
                self.tokens[self.pos + i] = -1
            self.pos += a + 1
        self.events.append(f"iterations {n}")

    def run(self, n, marks=None):
        for _ in range(n):
            self.pos += 1
            self.tokens[self.pos] = _truth(self.pos)
        self.events.append(f"steps {n}")

    def _handle(self, value):
        self.inflight += 1
        self.most_inflight = max(self.most_inflight, self.inflight)
        self.events.append("read")
        step = self

        class Handle:
            def wait(self):
                step.inflight -= 1
                step.events.append("wait")
                return value
        return Handle()

    def read_spec(self, lo, hi):
        assert 0 <= lo < hi <= self.max_seq
        return self._handle((self.tokens[lo:hi], self.pos))

    def read_tokens(self, lo, hi):
        return self._handle(self.tokens[lo:hi])

    @staticmethod
    def mark_ms(marks):
        return []


@pytest.mark.parametrize("script,max_new,max_seq", [
    ([3] * 40, 30, 200),          # every draft accepted: 4 tokens an iteration
    ([0] * 40, 12, 200),          # none: 1 token an iteration
    ([2, 0, 3, 1, 0, 0, 3, 2, 1, 3] * 4, 33, 200),
    ([3] * 40, 45, 50),           # max_seq: iterations stop at 50 - 2K - 2, plain steps finish
])
def test_speculative_read_back_two_batches_in_flight(script, max_new, max_seq):
    from kestrel.runtime.generate import READBACK_EVERY

    k, prompt = 3, [1, 2, 3, 4, 5]
    step = ScriptedSpecStep(max_seq, k, script)
    g = generate(step, prompt, max_new, SamplingParams())
    assert g.tokens == [_truth(i) for i in range(len(prompt), len(prompt) + max_new)]
    assert step.most_inflight <= 2 and step.inflight <= 2
    assert step.events[:2] == ["prefill", "read"]
    first_wait = step.events.index("wait")
    assert step.events[2] == f"iterations {min(READBACK_EVERY // 2, max_new - 1)}" and first_wait > 3  # the
    # first batch is enqueued before the prefill's read-back is waited for
    ran = sum(int(e.split()[1]) for e in step.events if e.startswith("iterations"))
    assert g.spec_iterations <= ran and g.draft_tokens == k
    assert g.spec_accepted == sum(script[:g.spec_iterations])
    for e in step.events:  # never more iterations than tokens still possibly missing
        assert not e.startswith("iterations") or int(e.split()[1]) <= READBACK_EVERY // 2
    plain = [e for e in step.events if e.startswith("steps")]
    assert bool(plain) == (max_seq < 100)  # plain steps only where iterations no longer fit


def test_speculative_read_back_stops_at_eos():
    prompt = [1, 2, 3, 4, 5]
    step = ScriptedSpecStep(200, 3, [2, 3, 1, 0, 3] * 10)
    eos = _truth(len(prompt) + 9)
    g = generate(step, prompt, 40, SamplingParams(), eos_ids={eos})
    assert g.stopped_by == "eos" and g.tokens == [_truth(i) for i in range(len(prompt), len(prompt) + 10)]
    assert step.inflight <= 2 and not any(e.startswith("steps") for e in step.events)
