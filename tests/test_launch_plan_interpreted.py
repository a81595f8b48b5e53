"""The GPU path without a GPU: a real sm_90 plan's launch list — its kernels, grids, packed argument
order, arena offsets and scalars exactly as the GPU runtime uses them — executed in Triton's
interpreter over one byte arena, against the CPU reference path, step by step. This is the test
that catches ABI mistakes (argument order, offsets, dtypes) that per-kernel tests cannot see.
"""
import os
import re

import numpy as np
import pytest
import torch

from kestrel.artifacts.plan import load_plan
from kestrel.compiler.codegen import jit_function
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.launch_binding import bind

PTR = {"*fp32": torch.float32, "*bf16": torch.bfloat16, "*i32": torch.int32, "*u8": torch.uint8,
       "*fp16": torch.float16}


class InterpretedPlan:
    """The launch plan bound (runtime/launch_binding.bind, as the GPU runtime binds it) to offset 0 of
    one byte tensor, every launch run in the interpreter: a pointer parameter becomes a view of the
    arena at its bound address."""

    def __init__(self, plan):
        lp = plan.launch_plan
        self.lp, self.b = lp, bind(lp, 0)
        self.arena = torch.zeros(self.b.arena_bytes, dtype=torch.uint8)
        for name, addr, nbytes in self.b.weights:
            data = torch.from_numpy(np.frombuffer(plan.read(name), dtype=np.uint8).copy())
            assert data.numel() == nbytes
            self.arena[addr:addr + nbytes] = data

    def view(self, off, ptr_type):
        dt = PTR[ptr_type]
        size = torch.tensor([], dtype=dt).element_size()
        n = (self.arena.numel() - off) // size
        return self.arena[off:off + n * size].view(dt)

    def dyn(self, name, value=None):
        slot = self.b.dyn[name]
        v = self.view(slot.address, "*i32" if slot.dtype == "i32" else "*fp32")
        if value is not None:
            v[0] = value
        return v[0].item()

    def run(self, launches=None):
        for launch in self.b.launches if launches is None else launches:
            k = self.lp["kernels"][launch.kernel_index]
            args = [self.view(v, t) if t.startswith("*") else v for v, t in zip(launch.values, launch.types)]
            consts = dict(k["constexprs"])
            if "DOT_FP32" in consts:  # the interpreter computes bf16 dots wrongly: the same values as fp32
                consts["DOT_FP32"] = True
            jit_function(k["jit"])[launch.grid](*args, **consts)

    def run_prefill(self):
        self.run(self.b.prefill_launches)

    def output(self, name, prefill=False):
        o = (self.b.prefill_outputs if prefill else self.b.outputs)[name]
        return self.view(o.address, "*fp32")[:o.numel].clone()


# Every plan here is built with the matvec rules' rows per CTA let grow to their largest (16 rows a CTA; q4: the
# q4_max_block_n, in the one-row and the few-rows matvecs): at the mini shapes the rules keep one row a CTA (a grid of
# 4 CTAs an SM on 132 SMs), and the interpreter runs each program in Python, so the matvecs took ~90% of this file's
# time (stop 51: the speculative test 152 s -> 18 s). The kernels are the same; the split is the kind real shapes
# get (several rows a CTA, a masked last block).
INTERPRETER_RULES = "matvec.ctas_per_sm=0 matvec.q4_ctas_per_sm=0 matvec_rows.q4_ctas_per_sm=0"


@pytest.fixture(autouse=True)
def _interpreter_rules(monkeypatch):
    monkeypatch.setenv("KESTREL_RULES", INTERPRETER_RULES)


def _rules(monkeypatch, rules: str) -> None:
    """A test's own rules (KESTREL_RULES, read by kestrelc build) on top of INTERPRETER_RULES."""
    monkeypatch.setenv("KESTREL_RULES", f"{INTERPRETER_RULES} {rules}")


# small enough for the interpreter (it runs every program of every grid in Python), with both layer
# kinds, GQA, more GDN value than key heads, and a hidden size that gives q4 group 32
MINI = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            rms_norm_eps=1e-6, max_position_embeddings=128)


def _write_checkpoint(folder: str, raw: dict, seed: int) -> str:
    """A checkpoint of config ``raw`` with random weights (presets.random_weights) in ``folder``."""
    import json
    import os

    from safetensors.numpy import save_file

    from kestrel.compiler.frontend import expected_tensors, parse_config
    from kestrel.compiler.presets import random_weights

    cfg = parse_config(raw)
    shapes = {"model." + n: s for n, s in expected_tensors(cfg)}
    shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    save_file(random_weights(shapes, seed), os.path.join(folder, "model.safetensors"))
    json.dump(raw, open(os.path.join(folder, "config.json"), "w"))
    return folder


@pytest.fixture(scope="module")
def mini_checkpoint(tmp_path_factory):
    return _write_checkpoint(str(tmp_path_factory.mktemp("mini")), MINI, 7)


def _begin(gpu, cpu, prompt: list[int]):
    """A greedy request with ``prompt`` on both paths (the CPU path's begin; the interpreted plan's dyn
    slots and token rows written as the runtime's begin writes them); the interpreted token sequence."""
    cpu.begin(prompt, 0.0, 1.0, 0)
    for name, v in (("temperature", 0.0), ("top_p", 1.0), ("seed", 0), ("token", prompt[0]),
                    ("n_prompt", len(prompt))):
        gpu.dyn(name, v)
    tokens = gpu.view(gpu.b.tokens.address, "*i32")[:gpu.b.tokens.numel]
    tokens[:len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
    return tokens


def _close(what, g, c, bound):
    rel = ((g - c).abs().max() / c.abs().max()).item()
    assert rel < bound, f"{what} differ by {rel:.2e}"


@pytest.mark.parametrize("quant", ["bf16", "q4", "q4-stream", "q4-stream-wide", "q4-mma-one-row"])
def test_sm90_plan_in_interpreter_matches_cpu_reference(quant, mini_checkpoint, tmp_path, monkeypatch):
    """q4-stream: the bulk-copy q4 kernel (kernels/q4_stream.py, emulated; by default on the 27B-class normed
    gate / up pair only) with its add form on and thresholds the mini model's shapes pass: the normed pair and the
    residual adds, whose partials feed the next norm. q4-stream-wide: the down projection (K 64) as the wide form,
    its K split over two warps a row group (a partial per group of 4 rows), registers for 2 CTAs an SM.
    q4-mma-one-row: the one-token step's q4 products on the tensor-core kernel (emulated) at M = 1, split as at 4
    rows (rule q4_mma.one_row_as, an experiment): the add form's 16-row partials feed the normed forms."""
    from conftest import run_cli

    one_row = quant == "q4-mma-one-row"
    if one_row:
        _rules(monkeypatch, "q4_mma.one_row_as=4")
        quant = "q4"
    stream = quant.startswith("q4-stream")
    if stream:
        rules = ("q4_stream.add=True q4_stream.min_rows=16 q4_stream.min_k=32 q4_stream.rb=8 q4_stream.nc=2 "
                 "q4_stream.pair_rb=16 q4_stream.pair_nc=4")
        if quant == "q4-stream-wide":
            rules += (" q4_stream.max_k=32 q4_stream.wide=True q4_stream.wide_max_k=64 q4_stream.wide_rb=8 "
                      "q4_stream.wide_nc=4 q4_stream.wide_ks=2 q4_stream.wide_minb=2")
        _rules(monkeypatch, rules)
    path = str(tmp_path / f"mini-{quant}.plan")
    wide = quant == "q4-stream-wide"
    quant = "q4" if stream else quant
    r = run_cli("kestrelc", "build", mini_checkpoint, "-o", path, "--target", "sm_90", "--quant", quant,
                "--max-seq", "16")
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    ids = {k["id"] for k in plan.launch_plan["kernels"]}
    assert stream == ({"q4stream_norm_swiglu_q4g32", "q4stream_add_q4g32"} <= ids), sorted(ids)
    step_ids = {plan.launch_plan["kernels"][x["kernel_index"]]["id"] for x in plan.launch_plan["launches"]}
    assert one_row == ({"q4mma_add_q4g32", "q4mma_norm_q4g32", "q4mma_norm_swiglu_q4g32"} <= step_ids), sorted(step_ids)
    if one_row:
        assert re.findall(r'kernel="q4mma_add_q4g32"[^\n]*M=1, ', plan.program_text)
    if wide:  # the down projections took the wide split; the attention out projection (K 32) the single one
        assert re.findall(r'kernel="q4stream_add_q4g64"[^\n]*K=64[^\n]*MINB=2, KS=2, ADD=1, BLOCK_N=4', plan.program_text)
        assert re.findall(r'kernel="q4stream_add_q4g32"[^\n]*K=32[^\n]*NC=2, XREG_MAX=5, ADD=1', plan.program_text)
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    prompt = [5, 9]
    tokens = _begin(gpu, cpu, prompt)
    for step in range(4):  # two prompt tokens, then the kernels feed the sampled tokens back themselves
        gpu.run()
        cpu.run()
        assert torch.equal(tokens, cpu.states["tokens"]), f"step {step}: token sequence"
        g, c = gpu.output("logits"), cpu.outputs["logits"]
        # (the tensor-core form's arithmetic, q4_mma_ref, is not the CPU path's f16 lanes: ~7e-4 of max |logit|)
        bound = 2e-3 if one_row else 1e-4
        rel = ((g - c).abs().max() / c.abs().max()).item()
        assert rel < bound, f"step {step}: logits differ by {rel:.2e}"
        h_rel = ((gpu.output("hidden") - cpu.outputs["hidden"]).abs().max() / cpu.outputs["hidden"].abs().max()).item()
        assert h_rel < bound, f"step {step}: hidden states differ by {h_rel:.2e}"
        for slot in ("pos", "token", "sampled"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"step {step}: dyn.{slot}"


def test_sm90_random_weights_plan_in_interpreter_matches_cpu_reference(tmp_path):
    """A ``--weights random`` q4 plan: its fill launches (the region chunk by chunk, then each q4 weight's
    scales) run in the interpreter give the weights the CPU path makes with the numpy twin, so the two
    paths' steps agree, and the logits are finite and not flat."""
    import json

    from conftest import run_cli

    folder = tmp_path / "cfg"
    folder.mkdir()
    json.dump(MINI, open(folder / "config.json", "w"))
    path = str(tmp_path / "mini-random-q4.plan")
    r = run_cli("kestrelc", "build", str(folder), "-o", path, "--target", "sm_90", "--quant", "q4", "--max-seq", "16",
                "--weights", "random", "--seed", "11")
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    assert plan.random_weights == {"kind": "random", "seed": 11, "q4_scales": True}
    fills = plan.launch_plan["fill"]
    n_q4 = sum(1 for line in plan.program_text.splitlines() if line.lstrip().startswith("weight") and ": q4g" in line)
    assert n_q4 > 0 and len(fills) == 1 + n_q4, (len(fills), n_q4)
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    gpu.run(gpu.b.fill)
    tokens = _begin(gpu, cpu, [5, 9])
    for step in range(3):
        gpu.run()
        cpu.run()
        assert torch.equal(tokens, cpu.states["tokens"]), f"step {step}: token sequence"
        g, c = gpu.output("logits"), cpu.outputs["logits"]
        assert torch.isfinite(c).all() and c.std() > 1e-3 * c.abs().max(), f"step {step}: {c}"
        _close(f"step {step}: logits", g, c, 1e-4)


@pytest.mark.parametrize("quant", ["bf16", "bf16-triton", "q4", "q4-triton", "bf16-attn-split", "bf16-attn-step"])
def test_sm90_m_row_step_in_interpreter_matches_cpu_reference(quant, mini_checkpoint, tmp_path, monkeypatch):
    """The M-row step's launch list (4 rows) over a 6-token prompt: a full chunk, then a partial one;
    then the one-token step takes over from the states it left. The GPU GEMM feeds the tensor cores
    bf16 activations where the CPU reference multiplies in fp32: the bound is that rounding's. q4: the
    tensor-core q4 kernel (emulated here, kernels/q4_mma.py); q4-triton: with it turned off (KESTREL_RULES),
    the few-rows matvec. bf16: the tensor-core bf16 kernel (kernels/bf16_mma.py, emulated), bf16-triton: the
    few-rows matvec. bf16-attn-split: the attention split over the sequence in 16-row splits (KESTREL_RULES;
    max_seq 64: 4 splits) over a 22-token prompt, so the later chunks merge two splits' partials. bf16-attn-step: the
    chunk's attention row by row as the one-token step computes it (attn_rows.step_order_rows, kernels/attention.py
    attn_rows_step_kernel; its splits of 16 rows over the 22-token prompt: the later rows merge two)."""
    from conftest import run_cli

    mma = quant in ("q4", "bf16", "bf16-attn-split")
    max_seq, prompt = 16, [5, 9, 3, 60, 17, 2]
    if quant.endswith("-triton"):
        quant = quant.removesuffix("-triton")
        _rules(monkeypatch, f"{quant}_mma.max_rows=0")
    elif quant == "bf16-attn-split":
        _rules(monkeypatch, "attn_rows.split_tiles=1 attn_rows.max_block_n=16")
        quant, max_seq, prompt = "bf16", 64, [(7 * i + 5) % 61 + 1 for i in range(22)]
    elif quant == "bf16-attn-step":
        _rules(monkeypatch, "attn_rows.step_order_rows=4 attention.split_tiles=1 "
                            "attention.min_rows_per_split=16 attention.max_block_s=16")
        quant, max_seq, prompt = "bf16", 64, [(7 * i + 5) % 61 + 1 for i in range(22)]
        mma = True

    path = str(tmp_path / f"mini-rows-{quant}.plan")
    r = run_cli("kestrelc", "build", mini_checkpoint, "-o", path, "--target", "sm_90", "--quant", quant,
                "--max-seq", str(max_seq), "--prefill-rows", "4")
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    assert plan.launch_plan["prefill"]["rows"] == 4
    ids = {k["id"] for k in plan.launch_plan["kernels"]}
    # with the kernel, the residual adds and norms between its products are folded in (fold_row_norms)
    kind = "q4mma" if quant == "q4" else "bf16mma"
    assert mma == all(any(i.startswith(kind + p) for i in ids) for p in ("_rows_", "_add_", "_norm_", "_norm_swiglu_")), \
        sorted(ids)
    splits = {x["constexprs"]["SPLITS"] for x in plan.launch_plan["prefill"]["launches"] if x["op"] == "attn_rows_q"}
    assert splits == ({4} if max_seq == 64 else {1}), splits
    kernels = {x["kernel"] for x in plan.launch_plan["prefill"]["launches"] if x["op"] == "attn_rows_q"}
    step_order = "step_order" in os.environ.get("KESTREL_RULES", "")
    assert kernels == {"attn_rows_step_bf16" if step_order else "attn_rows_q_bf16"}, kernels
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    tokens = _begin(gpu, cpu, prompt)

    for chunk in range(-(-len(prompt) // 4)):
        gpu.run_prefill()
        cpu.run_prefill(1)
        for slot in ("pos", "token", "last", "sampled"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"chunk {chunk}: dyn.{slot}"
        for name in ("layers.0.recurrent_state", "layers.0.conv_state", "layers.1.k_cache", "layers.1.v_cache"):
            w = cpu.program.states[name]
            g = gpu.view(gpu.b.regions["state"] + w.loc[1], {"f32": "*fp32", "bf16": "*bf16"}[w.type.dtype])
            _close(f"chunk {chunk}: {name}", g[:w.type.numel].float().reshape(w.type.shape),
                   cpu.states[name].float(), 2e-2)
        _close(f"chunk {chunk}: logits", gpu.output("logits", prefill=True), cpu.outputs["logits"], 2e-2)
    assert gpu.dyn("pos") == len(prompt) and torch.equal(tokens, cpu.states["tokens"])
    for step in range(3):  # the one-token step continues from the M-row step's states
        gpu.run()
        cpu.run()
        assert gpu.dyn("pos") == cpu.dyn["pos"]
        _close(f"decode step {step}: logits", gpu.output("logits"), cpu.outputs["logits"], 3e-2)


MINI_YARN = dict(MINI, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                        "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False})


@pytest.mark.parametrize("attn", ["flash", "step-order"])
def test_sm90_yarn_plan_in_interpreter_matches_cpu_reference(attn, tmp_path, monkeypatch):
    """YaRN (rope_type yarn): every attention kernel of the sm_90 plan compiled with its ``YARN`` constexpr (the
    M-row step's attn_rows_kv and attn_rows_q, or with step-order rows attn_rows_step, over a 6-token prompt in
    chunks of 4; then the one-token step's attn_step) against the CPU path: the caches after each chunk, the logits
    of each chunk and step, the token sequence."""
    from conftest import run_cli

    if attn == "step-order":
        _rules(monkeypatch, "attn_rows.step_order_rows=4")
    ckpt = _write_checkpoint(str(tmp_path), MINI_YARN, 7)
    path = str(tmp_path / "mini-yarn.plan")
    r = run_cli("kestrelc", "build", ckpt, "-o", path, "--target", "sm_90", "--quant", "bf16", "--max-seq", "16",
                "--prefill-rows", "4")
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    rope = [x for x in plan.launch_plan["launches"] + plan.launch_plan["prefill"]["launches"]
            if x["op"].startswith("attn_")]
    kernels = {x["kernel"] for x in rope}
    assert kernels == {"attn_step_bf16", "attn_rows_kv_bf16",
                       "attn_rows_step_bf16" if attn == "step-order" else "attn_rows_q_bf16"}, kernels
    yarn = plan.manifest["model"]["rope_yarn"]
    assert yarn and all(x["constexprs"]["YARN"] == list(yarn) and "yarn" not in map(str, x["scalars"]) and
                        len(x["scalars"]) == len(x["attrs"]) - 1 for x in rope)
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    prompt = [5, 9, 3, 60, 17, 2]
    tokens = _begin(gpu, cpu, prompt)
    for chunk in range(2):
        gpu.run_prefill()
        cpu.run_prefill(1)
        for name in ("layers.1.k_cache", "layers.1.v_cache"):
            w = cpu.program.states[name]
            g = gpu.view(gpu.b.regions["state"] + w.loc[1], "*bf16")
            _close(f"chunk {chunk}: {name}", g[:w.type.numel].float().reshape(w.type.shape), cpu.states[name].float(),
                   2e-2)
        _close(f"chunk {chunk}: logits", gpu.output("logits", prefill=True), cpu.outputs["logits"], 2e-2)
    assert gpu.dyn("pos") == len(prompt) and torch.equal(tokens, cpu.states["tokens"])
    for step in range(3):
        gpu.run()
        cpu.run()
        assert torch.equal(tokens, cpu.states["tokens"]), f"step {step}: token sequence"
        _close(f"decode step {step}: logits", gpu.output("logits"), cpu.outputs["logits"], 3e-2)


def _state(gpu, cpu):
    """state(name): a state of the plan as the interpreted arena and the CPU path hold it (f32)."""
    def state(name):
        w = cpu.states[name]
        st = next(p.states[name] for p in (cpu.spec_program, cpu.program) if name in p.states)
        g = gpu.view(gpu.b.regions["state"] + st.loc[1], {"f32": "*fp32", "bf16": "*bf16"}[st.type.dtype])
        return g[:st.type.numel].float().reshape(st.type.shape), w.float()
    return state


def _speculate(gpu, cpu, tokens, iterations: int, state) -> list[int]:
    """The speculative prefill (one chunk) and ``iterations`` iterations, greedy, on both paths: the same dyn
    slots (drafts, acceptances, positions) and token sequence after each; the head's k cache, the verify's
    logits and the first GDN layer's states (its snapshots included) within the GEMM's bf16 rounding.
    Returns the drafts accepted per iteration."""
    gpu.run(gpu.b.spec_prefill_launches)
    cpu.run_spec_prefill(1)
    for slot in ("pos", "token", "sampled", "dpos", "draft"):
        assert gpu.dyn(slot) == cpu.dyn[slot], f"prefill: dyn.{slot}"
    assert torch.equal(tokens, cpu.states["tokens"]), "prefill: token sequence"
    _close("prefill: the head's k cache", *state("mtp.layers.0.k_cache"), 3e-2)
    accepted = []
    for it in range(iterations):
        gpu.run(gpu.b.spec_launches)
        cpu.run_spec(1)
        for slot in ("pos", "token", "sampled", "npos", "dpos", "draft", "accepted", "vend"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"iteration {it}: dyn.{slot}"
        assert torch.equal(tokens, cpu.states["tokens"]), f"iteration {it}: token sequence"
        _close(f"iteration {it}: verify logits", gpu.view(gpu.b.spec_outputs["logits"].address, "*fp32")[
            :gpu.b.spec_outputs["logits"].numel], cpu.outputs["logits"].reshape(-1), 3e-2)
        for name in ("layers.0.recurrent_state", "layers.0.conv_state", "layers.0.recurrent_rows"):
            _close(f"iteration {it}: {name}", *state(name), 3e-2)
        accepted.append(gpu.dyn("accepted"))
    return accepted


@pytest.mark.parametrize("attn", ["flash", "step-order"])
def test_sm90_speculative_programs_in_interpreter_match_cpu_reference(attn, mini_checkpoint, tmp_path, monkeypatch):
    """--speculative mtp (K = 2, bf16): the speculative prefill's and iteration's launch lists (the MTP
    head over rows and one row, the verify with its rows' states, acceptance, the commit, drafts) in the
    interpreter against the CPU path: the same drafts, acceptances, positions and token sequence,
    states within the GEMM's bf16 rounding; then the one-token step takes over from the states the
    iterations left. (A prompt of one partial chunk and two iterations: the interpreter is slow; the
    CPU path's tests cover many chunks and iterations.) step-order: the verify's attention by attn_rows_step_kernel,
    each row as the one-token step computes it (a speculative plan's default: exact_verify_rules); flash: by
    attn_rows_q_kernel (the rule attn_rows.step_order_rows=0 given on top)."""
    import shutil

    from conftest import run_cli
    from hf_checkpoints import add_mtp_head

    ckpt = str(tmp_path / "mtp")
    shutil.copytree(mini_checkpoint, ckpt)
    add_mtp_head(ckpt, seed=14)  # (a head whose drafts have no near-tie the GEMM's bf16 rounding could flip)
    path = str(tmp_path / "mini-spec.plan")
    if attn == "flash":
        _rules(monkeypatch, "attn_rows.step_order_rows=0")
    r = run_cli("kestrelc", "build", ckpt, "-o", path, "--target", "sm_90", "--quant", "bf16", "--max-seq", "24",
                "--prefill-rows", "4", "--speculative", "mtp", "--draft-tokens", "2")
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    lp = plan.launch_plan
    ids = [k["id"] for k in lp["kernels"]]
    kinds = {ids[x["kernel_index"]] for x in lp["speculative"]["iteration"]["launches"] if x["op"] == "attn_rows_q"}
    assert kinds == {"attn_rows_step_bf16" if attn == "step-order" else "attn_rows_q_bf16"}, kinds
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    assert gpu.b.draft_tokens == cpu.spec_k == 2
    prompt = [5, 9, 3]
    tokens = _begin(gpu, cpu, prompt)

    state = _state(gpu, cpu)
    accepted = _speculate(gpu, cpu, tokens, 2, state)
    print(f"accepted per iteration: {accepted}")
    for step in range(1):  # the one-token step continues from the iterations' states
        gpu.run()
        cpu.run()
        assert gpu.dyn("pos") == cpu.dyn["pos"] and gpu.dyn("sampled") == cpu.dyn["sampled"]
        _close(f"decode step {step}: logits", gpu.output("logits"), cpu.outputs["logits"], 3e-2)
    # speculative sampling at temperature 1 (a new request, reset as the runtime's begin resets): the drafts
    # drawn from q (kept in spec.draft_probs), the accept / residual decisions, on the device as on the CPU
    for addr, nbytes in gpu.b.reset:
        gpu.arena[addr:addr + nbytes] = 0
    cpu.begin(prompt, 1.0, 1.0, 5)
    for name, v in (("temperature", 1.0), ("top_p", 1.0), ("seed", 5), ("token", prompt[0]),
                    ("n_prompt", len(prompt))):
        gpu.dyn(name, v)
    tokens[:len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
    gpu.run(gpu.b.spec_prefill_launches)
    cpu.run_spec_prefill(1)
    decided = []
    for it in range(1):
        _close(f"sampled iteration {it}: q rows", *state("spec.draft_probs"), 3e-2)
        gpu.run(gpu.b.spec_launches)
        cpu.run_spec(1)
        for slot in ("pos", "sampled", "accepted", "draft"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"sampled iteration {it}: dyn.{slot}"
        assert torch.equal(tokens, cpu.states["tokens"]), f"sampled iteration {it}: token sequence"
        decided.append(gpu.dyn("accepted"))
    # controlled acceptance: the drafts replaced by a replayed sequence (half of them corrupted), the
    # replayed tokens emitted
    seq = [int(t) for t in tokens[:gpu.dyn("pos") + 1]] + [7, 11, 13, 17, 19, 23]
    cpu.set_replay(seq, 0.5)
    rp = gpu.view(gpu.b.spec_replay.address, "*i32")[:gpu.b.spec_replay.numel]
    rp[:] = 0
    rp[:len(seq)] = torch.tensor(seq, dtype=torch.int32)
    gpu.dyn("replay", 1)
    gpu.dyn("replay_accept", 0.5)
    for it in range(1):
        gpu.run(gpu.b.spec_launches)
        cpu.run_spec(1)
        for slot in ("pos", "sampled", "accepted"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"replayed iteration {it}: dyn.{slot}"
        assert torch.equal(tokens, cpu.states["tokens"]), f"replayed iteration {it}: token sequence"
    assert [int(t) for t in tokens[:gpu.dyn("pos") + 1]] == seq[:gpu.dyn("pos") + 1]
    print(f"sampled: accepted {decided}")


# Qwen3-Next at interpreter size: fused GDN projections, a sparse MoE MLP in both layers (6 experts, top 3,
# a shared expert of another width), so the routing buffers, stacked experts and grouped kernels run
MINI_NEXT = dict(MINI, model_type="qwen3_next", num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


# Qwen3.5 MoE at interpreter size: MINI's layers (unfused GDN projections) with MINI_NEXT's MoE block in both
MINI_Q35_MOE = dict({k: v for k, v in MINI_NEXT.items() if k not in ("intermediate_size", "norm_topk_prob",
                                                                     "decoder_sparse_step", "mlp_only_layers")},
                    model_type="qwen3_5_moe_text")


@pytest.fixture(scope="module")
def mini_next_checkpoint(tmp_path_factory):
    return _write_checkpoint(str(tmp_path_factory.mktemp("mini-next")), MINI_NEXT, 11)


@pytest.fixture(scope="module")
def mini_q35_moe_checkpoint(tmp_path_factory):
    return _write_checkpoint(str(tmp_path_factory.mktemp("mini-q35-moe")), MINI_Q35_MOE, 12)


@pytest.mark.parametrize("quant,rows,model", [("bf16", 4, "next"), ("q4", 16, "next"), ("q4-triton", 16, "next"),
                                              ("q4", 0, "next"), ("bf16", 4, "q35_moe"), ("q4", 0, "q35_moe")])
def test_sm90_moe_plan_in_interpreter_matches_cpu_reference(quant, rows, model, request, tmp_path, monkeypatch):
    """A Qwen3-Next sm_90 plan's launch lists (``q35_moe``: a Qwen3.5 MoE plan's, its GDN projections unfused) in
    the interpreter against the CPU path. With rows: the M-row
    step (4 rows: each row's experts on its own; 16: grouped by expert, kernels/moe.py; one chunk of a
    4-token prompt whose rows route to different experts),
    then a one-token step (within the M-row GEMM's bf16 rounding, as the dense test); q4: one-token steps
    from the first prompt token (within 1e-4; every q4 plan has the one-tile q4 matvecs' TOGETHER, the rule). Each
    step's last routing buffer holds the experts the CPU reference chose, the same tokens come out."""
    from conftest import run_cli
    from kestrel.compiler.ops import is_view

    mma = quant == "q4" and rows == 16  # the grouped q4 experts on the tensor-core kernel (emulated here) ...
    if quant == "q4-triton":  # ... or, turned off (KESTREL_RULES), on the few-rows grouped kernels
        _rules(monkeypatch, "q4_mma.max_rows=0 q4_mma.grouped_rows=0")
        quant = "q4"
    path = str(tmp_path / f"mini-{model}-{quant}.plan")
    r = run_cli("kestrelc", "build", request.getfixturevalue(f"mini_{model}_checkpoint"), "-o", path, "--target", "sm_90", "--quant", quant,
                "--max-seq", "16", "--prefill-rows", str(rows))
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    kinds = [op.kind for op in cpu.program.ops]
    # (the one-token step folds the norms and residual adds around the MoE blocks into them: fuse's rule 7)
    assert kinds.count("moe_topk") == kinds.count("moe_gate_up") + kinds.count("rmsnorm_moe_gate_up") == \
        kinds.count("moe_down") + kinds.count("moe_down_add") == 2
    assert kinds.count("rmsnorm_moe_gate_up") == 2 and kinds.count("moe_down_add") == 1
    ids = {k["id"] for k in plan.launch_plan["kernels"]}
    assert mma == ({"q4mma_gate_up_grouped_q4g32", "q4mma_down_grouped_q4g32"} <= ids), sorted(ids)
    consts = {k["id"].split("_q4")[0].split("_bf16")[0]: k["constexprs"] for k in plan.launch_plan["kernels"]}
    assert any(c.get("TOGETHER") for c in consts.values()) == (quant == "q4")
    prompt = [5, 9, 3, 60] if rows else [5, 9]
    tokens = _begin(gpu, cpu, prompt)
    if rows >= 16:
        assert "moe_group" in [op.kind for op in cpu.prefill_program.ops], "the M-row step is not grouped by expert"
    for chunk in range(1 if rows else 0):
        gpu.run_prefill()
        cpu.run_prefill(1)
        for slot in ("pos", "token", "last", "sampled"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"chunk {chunk}: dyn.{slot}"
        _close(f"chunk {chunk}: logits", gpu.output("logits", prefill=True), cpu.outputs["logits"], 2e-2)
    assert torch.equal(tokens, cpu.states["tokens"])
    bound = 3e-2 if rows else 1e-4
    launch_ops = [op for op in cpu.program.ops if not is_view(op)]
    split = max(i for i, op in enumerate(launch_ops) if op.kind in ("moe_down", "moe_down_add")) + 1
    router = [op for op in launch_ops if op.kind == "moe_topk"][-1]
    for step in range(1 if rows else 3):
        gpu.run(gpu.b.launches[:split])  # up to the last MoE block: its routing buffer is still live
        ids = gpu.view(gpu.b.regions["act"] + router.outs[0].loc[1], "*i32")[:3].clone()
        wts = gpu.view(gpu.b.regions["act"] + router.outs[1].loc[1], "*fp32")[:3].clone()
        gpu.run(gpu.b.launches[split:])
        cpu.run()
        assert ids.tolist() == cpu.values[id(router.outs[0])].tolist(), f"step {step}: routed experts"
        _close(f"step {step}: routing weights", wts, cpu.values[id(router.outs[1])], bound)
        assert torch.equal(tokens, cpu.states["tokens"]), f"step {step}: token sequence"
        for slot in ("pos", "token", "sampled"):
            assert gpu.dyn(slot) == cpu.dyn[slot], f"step {step}: dyn.{slot}"
        _close(f"step {step}: logits", gpu.output("logits"), cpu.outputs["logits"], bound)


# Qwen3-Next with an MTP head at interpreter size: the GDN layer's MLP and the head's layer sparse MoE blocks (4
# experts, top 2; the attention layer dense: mlp_only_layers), so the head's routing buffers and stacked experts
# run in both speculative programs. (tiny-next-mtp itself is too slow here: its moe_down alone, one program per
# output row, took 50 s an iteration in the interpreter.)
MINI_NEXT_MTP = dict(MINI_NEXT, mlp_only_layers=[1], num_experts=4, num_experts_per_tok=2,
                     shared_expert_intermediate_size=32)


@pytest.mark.parametrize("quant,k,iterations", [("bf16", 1, 1), ("q4", 2, 0)])
def test_sm90_qwen3_next_speculative_programs_in_interpreter(quant, k, iterations, tmp_path):
    """--speculative mtp on Qwen3-Next (sm_90): the speculative prefill's launch list (the M-row step with its
    MoE block, the head's MoE block over the chunk's rows and, in q4 at K = 2, at one row for the second draft)
    and, in bf16, an iteration's (the verify at K + 1 rows with snapshots, acceptance, rollback, the head's MoE
    block over the verified rows) in the interpreter: the CPU path's drafts, acceptances and tokens (a 2-token
    prompt, 2-row chunks: the interpreter takes ~30 ms a MoE program, 8 s an iteration)."""
    from conftest import run_cli
    from hf_checkpoints import add_mtp_head

    ckpt = _write_checkpoint(str(tmp_path), MINI_NEXT_MTP, 11)
    add_mtp_head(ckpt, seed=14)
    path = str(tmp_path / f"mini-next-mtp-{quant}.plan")
    r = run_cli("kestrelc", "build", ckpt, "-o", path, "--target", "sm_90", "--quant", quant, "--max-seq", "16",
                "--prefill-rows", "2", "--speculative", "mtp", "--draft-tokens", str(k))
    assert r.returncode == 0, r.stderr
    plan = load_plan(path)
    gpu, cpu = InterpretedPlan(plan), CpuStep(plan)
    head_moe = [op.kind for op in cpu.spec_program.ops if op.kind.startswith(("moe_", "rmsnorm_moe"))
                and any(getattr(x, "name", "").startswith("mtp.") for x in op.ins)]
    assert head_moe.count("moe_gate_up") + head_moe.count("rmsnorm_moe_gate_up") == k, head_moe
    tokens = _begin(gpu, cpu, [5, 9])
    accepted = _speculate(gpu, cpu, tokens, iterations, _state(gpu, cpu))
    print(f"{quant}: tokens {tokens[:int(cpu.dyn['pos']) + k + 1].tolist()}, accepted per iteration {accepted}")
