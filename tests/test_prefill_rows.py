"""The M-row step (a plan's second program, issue 11), on the CPU reference path: prompts prefilled in
chunks of M tokens give exactly what the one-token step gives — the same tokens, logits and states,
for prompts shorter than M, of exactly M, and longer than M and not a multiple of it — and the plan
holds both programs over one arena."""
import json

import pytest
import torch

from conftest import run_cli
from kestrel.artifacts.errors import InputError, UnsupportedError
from kestrel.artifacts.plan import load_plan
from kestrel.compiler.build import build
from kestrel.compiler.ir_text import parse_program
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.generate import SamplingParams, generate

PROMPT = list(b"The M-row step prefills a prompt M tokens a run!")  # 48 tokens


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rows")
    out = {}
    for rows in (0, 4, 7):
        out[rows] = str(folder / f"rows{rows}.plan")
        build("tiny", out[rows], max_seq=128, log=lambda m: None, progress=False, prefill_rows=rows,
              quant="bf16")
    return out


def _run(plan_path, prompt, n_new=6, sampling=SamplingParams()):
    step = CpuStep(load_plan(plan_path))
    logits = []
    gen = generate(step, prompt, n_new, sampling,
                   on_step=lambda s, phase, pos, tok: logits.append(s.output("logits").copy()) if pos >= len(prompt) - 1
                   else None)
    return gen.tokens, logits, {k: v.clone() for k, v in step.states.items() if not k.startswith("scratch.")}


@pytest.mark.parametrize("n", [1, 3, 4, 7, 15, 48])
@pytest.mark.parametrize("rows", [4, 7])
def test_prefill_rows_equal_the_one_token_step(plans, n, rows):
    tokens0, logits0, states0 = _run(plans[0], PROMPT[:n])
    tokens, logits, states = _run(plans[rows], PROMPT[:n])
    assert tokens == tokens0
    # the CPU reference runs each row as the one-token step does: bit for bit (a GPU kernel will not be)
    assert all((a == b).all() for a, b in zip(logits, logits0)) and len(logits) == len(logits0)
    assert states.keys() == states0.keys() and all(torch.equal(states[k], states0[k]) for k in states)


def test_sampled_and_batched_runs_agree(plans):
    s = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    a = generate(CpuStep(load_plan(plans[0])), PROMPT[:30], 12, s)
    b = generate(CpuStep(load_plan(plans[7])), PROMPT[:30], 12, s)
    assert a.tokens == b.tokens


def test_the_plan_holds_both_programs_over_one_arena(plans):
    plan = load_plan(plans[7])
    assert plan.manifest["prefill_rows"] == 7 and plan.prefill_rows == 7
    one, rows = parse_program(plan.program_text), parse_program(plan.prefill_program_text)
    assert one.arena == rows.arena
    assert {n: (w.type, w.loc) for n, w in one.weights.items()} == {n: (w.type, w.loc) for n, w in rows.weights.items()}
    shared = set(one.states) & set(rows.states)
    # the M-row step's own: only its attention's split scratch (placed after the step's states)
    assert set(rows.states) - shared == {"scratch.attn_rows7_partials", "scratch.attn_rows7_tickets"}
    assert all(one.states[s].loc == rows.states[s].loc for s in shared)
    assert all(one.dyn[d].loc == rows.dyn[d].loc for d in one.dyn) and "last" in rows.dyn
    kinds = [op.kind for op in rows.ops]
    assert kinds[0] == "embedding_rows" and kinds[-1] == "prefill_end"
    assert {"gdn_rows_delta", "gdn_rows_norm", "attn_rows_kv", "attn_rows_q"} <= set(kinds)
    assert "embedding" not in kinds and "gated_delta_step" not in kinds and "gdn_rows" not in kinds
    assert load_plan(plans[0]).prefill_program_text is None


def test_gpu_plans_carry_the_m_row_launch_list(tmp_path):
    with pytest.raises(InputError, match="--prefill-rows -1"):
        build("tiny", str(tmp_path / "g.plan"), prefill_rows=-1, log=lambda m: None, progress=False)
    logs = []
    # 16 rows: past the few rows that run the matvec (tests/test_kernels_matvec_rows.py), the GEMMs
    build("tiny", str(tmp_path / "g.plan"), target="sm_90", prefill_rows=16, log=logs.append, progress=False)
    assert any(m.startswith("dyn check (M=16 step): the launch list is identical") for m in logs)
    plan = load_plan(str(tmp_path / "g.plan"))
    lp = plan.launch_plan
    assert plan.prefill_rows == 16 and lp["prefill"]["rows"] == 16
    launches = lp["prefill"]["launches"]
    assert launches[0]["op"] == "embedding_rows" and launches[-1]["op"] == "prefill_end"
    assert {"gdn_rows_delta", "gdn_rows_norm", "attn_rows_kv", "attn_rows_q"} <= {x["op"] for x in launches}
    # one kernel table for both programs: the kernels both launch are compiled once (and the table
    # holds the measuring probes and the step's late-trigger variants besides: compiler/codegen.py)
    used = [{x["kernel_index"] for x in ls} for ls in (lp["launches"], launches)]
    probes = {p["kernel_index"] for p in lp["probes"].values()}
    late = {k["late"] for k in lp["kernels"] if "late" in k}
    assert used[0] | used[1] | probes | late == set(range(len(lp["kernels"]))) and used[0] & used[1] and probes
    ids = [k["id"] for k in lp["kernels"]]
    assert any(i.startswith("gemm_") for i in ids) and any(i.startswith("gemm_swiglu_") for i in ids)
    assert set(lp["prefill"]["outputs"]) == {"hidden", "logits"}
    assert not list(tmp_path.glob("*.partial-*"))


def test_prompt_file_and_json_fields(plans, tmp_path):
    text = "A prompt from a file, long enough for a few chunks of seven rows."
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    r = run_cli("kestrel-run", plans[7], "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == len(text.encode()) and out["prefill_rows"] == 7
    assert out["ttft_ms"] > 0 and out["prefill_tokens_per_s"] > 0
    r2 = run_cli("kestrel-run", plans[7], "--prompt-file", "-", "--max-new-tokens", "3", "--json", stdin=text)
    assert json.loads(r2.stdout)["tokens"] == out["tokens"]
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    r = run_cli("kestrel-run", plans[7], "--prompt-file", str(tmp_path / "bad.txt"))
    assert r.returncode == InputError.exit_code and "not UTF-8" in r.stderr
    (tmp_path / "long.txt").write_text("x" * 200)
    r = run_cli("kestrel-run", plans[7], "--prompt-file", str(tmp_path / "long.txt"))
    assert r.returncode == InputError.exit_code and "exceeds the plan's max_seq 128" in r.stderr


def test_all_rows_logits_equal_the_one_token_steps(tmp_path):
    """--prefill-logits all: every row of a chunk goes through the final norm and lm_head; on the CPU
    path each row's logits equal the one-token step's at that position bit for bit, and what is sampled
    (the last valid row's) is unchanged. On a GPU target the M-row step's logits output is [M, V]."""
    path = str(tmp_path / "all.plan")
    build("tiny", path, max_seq=32, prefill_rows=4, prefill_logits="all", log=lambda m: None, progress=False)
    plan = load_plan(path)
    assert plan.manifest["prefill_logits"] == "all"
    prompt = [5, 9, 3, 60, 17, 2, 11]  # a full chunk, then 3 valid rows of 4
    rows = CpuStep(plan)
    rows.begin(prompt, 0.0, 1.0, 0)
    chunks = []
    for _ in range(2):
        rows.run_prefill(1)
        chunks.append(rows.outputs["logits"].clone())
    one = CpuStep(plan)
    one.begin(prompt, 0.0, 1.0, 0)
    ref = []
    for _ in prompt:
        one.run(1)
        ref.append(one.outputs["logits"].clone())
    vocab = ref[0].numel()
    assert chunks[0].shape == (4, vocab)
    for r in range(4):
        assert torch.equal(chunks[0][r], ref[r])
    for r in range(3):
        assert torch.equal(chunks[1][r], ref[4 + r])
    assert rows.dyn["sampled"] == one.dyn["sampled"] and rows.dyn["pos"] == one.dyn["pos"] == len(prompt)
    gpu = str(tmp_path / "all-sm90.plan")
    build("tiny", gpu, target="sm_90", max_seq=32, prefill_rows=4, prefill_logits="all", log=lambda m: None,
          progress=False)
    out = load_plan(gpu).launch_plan["prefill"]["outputs"]
    assert out["logits"]["numel"] == 4 * vocab and out["hidden"]["numel"] == 4 * 128
    with pytest.raises(InputError, match="--prefill-logits every"):
        build("tiny", gpu, prefill_logits="every", log=lambda m: None, progress=False)
