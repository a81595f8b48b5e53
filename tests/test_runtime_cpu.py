"""kestrel-run on the CPU reference path: JSON output, dumps, sampling, stopping, input errors."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import run_cli
from kestrel.artifacts.errors import InputError
from kestrel.artifacts.plan import load_plan
from kestrel.kernels.sample import sample_ref, uniform_from
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.generate import READBACK_EVERY, SamplingParams, generate


def run_json(*args):
    r = run_cli("kestrel-run", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_json_output(tiny_plan):
    out = run_json(tiny_plan, "--prompt", "Hello", "--max-new-tokens", "16")
    assert set(out) >= {"tokens", "text", "mode", "ms_per_token"}
    assert len(out["tokens"]) == 16 and all(0 <= t < 320 for t in out["tokens"])
    assert isinstance(out["text"], str) and out["mode"] == "cpu-reference" and out["ms_per_token"] > 0
    assert out["prompt_tokens"] == 5  # byte-level tokenizer: one token per byte
    again = run_json(tiny_plan, "--prompt-ids", "72,101,108,108,111", "--max-new-tokens", "16")
    assert again["tokens"] == out["tokens"]  # same ids, greedy: same tokens


def test_dump(tiny_plan, tmp_path):
    d = tmp_path / "dump"
    out = run_json(tiny_plan, "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--dump", str(d))
    index = json.load(open(d / "index.json"))
    steps = index["steps"]
    assert len(steps) == 3 + 5 - 1 and index["shapes"] == {"logits": [320], "hidden": [128]}
    assert [s["phase"] for s in steps] == ["prefill"] * 3 + ["decode"] * 4
    assert [s["pos"] for s in steps] == list(range(7))
    assert [s["token_in"] for s in steps[3:]] == out["tokens"][:4]
    for s, tok in zip(steps[2:], out["tokens"]):
        logits = np.fromfile(d / s["logits"], dtype="<f4")
        hidden = np.fromfile(d / s["hidden"], dtype="<f4")
        assert logits.shape == (320,) and hidden.shape == (128,) and np.isfinite(logits).all()
        assert int(np.argmax(logits)) == tok == s["sampled"]


def test_sampling_is_seeded(tiny_plan):
    base = [tiny_plan, "--prompt", "The", "--max-new-tokens", "24", "--temperature", "1.0"]
    a = run_json(*base, "--seed", "1")["tokens"]
    assert run_json(*base, "--seed", "1")["tokens"] == a
    assert run_json(*base, "--seed", "2")["tokens"] != a
    greedy = run_json(tiny_plan, "--prompt", "The", "--max-new-tokens", "24")["tokens"]
    assert a != greedy
    # top-p keeping only the most likely token is greedy; so are top-k 1 and min-p 1
    assert run_json(*base, "--seed", "1", "--top-p", "1e-9")["tokens"] == greedy
    assert run_json(*base, "--seed", "1", "--top-k", "1")["tokens"] == greedy
    assert run_json(*base, "--seed", "1", "--min-p", "1")["tokens"] == greedy
    # truncation changes the draw (against plain temperature sampling with the same seed)
    assert run_json(*base, "--seed", "1", "--top-k", "20", "--top-p", "0.8", "--min-p", "0.05")["tokens"] not in (
        a, greedy)


def test_sample_ref_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-9]))
    draws = np.bincount([sample_ref(logits, 1.0, 1.0, 0, 0.0, seed, 0) for seed in range(4000)], minlength=4) / 4000
    assert np.allclose(draws[:3], [0.5, 0.3, 0.2], atol=0.03) and draws[3] == 0
    top = np.bincount([sample_ref(logits, 1.0, 0.6, 0, 0.0, seed, 7) for seed in range(2000)], minlength=4)
    assert top[2] == 0 and top[3] == 0  # 0.5 + 0.3 reaches top_p 0.6: only the first two remain
    assert all(0 <= uniform_from(s, p) < 1 for s in range(50) for p in range(50))


class TracedStep:
    """A step that logs the token loop's calls: runs, read-backs issued, read-backs waited on."""

    def __init__(self, step):
        self.step, self.log = step, []

    def begin(self, *a, **k):
        self.log.append(("begin",))
        self.step.begin(*a, **k)

    def run(self, n=1, marks=None):
        self.log.append(("run", n))
        self.step.run(n, marks)

    def run_prefill(self, n=1, marks=None):
        self.log.append(("prefill", n))
        self.step.run_prefill(n, marks)

    def read_tokens(self, lo, hi):
        self.log.append(("read", lo, hi))
        handle, log = self.step.read_tokens(lo, hi), self.log

        class Handle:
            def wait(self):
                log.append(("wait", lo, hi))
                return handle.wait()
        return Handle()

    def __getattr__(self, name):
        return getattr(self.step, name)

    def steps(self):
        return sum(e[1] for e in self.log if e[0] == "run")


def one_token_prefill(step):
    """The step with its M-row step switched off: the prompt goes through the one-token step."""
    step.prefill_rows = 0
    return step


@pytest.mark.parametrize("rows", [0, 64])
def test_token_loop_feeds_itself_and_reads_back_in_batches(tiny_plan, rows):
    plan = load_plan(tiny_plan)
    inner = CpuStep(plan)
    assert inner.prefill_rows == 64  # the cpu default
    step = TracedStep(one_token_prefill(inner) if rows == 0 else inner)
    plan.close()
    prompt, n_new, k = [1, 2, 3, 4, 5], 21, READBACK_EVERY
    gen = generate(step, prompt, n_new, SamplingParams())
    if rows == 0:
        assert step.steps() == len(prompt) + n_new - 1  # never a step beyond the last token asked for
        assert step.log[0] == ("begin",) and step.log[1] == ("run", len(prompt))  # the prompt in one go
    else:  # the prompt in one run of the M-row step, then only decode steps
        assert step.steps() == n_new - 1
        assert step.log[0] == ("begin",) and step.log[1] == ("prefill", 1)
    assert all(e[1] <= k // 2 for e in step.log[2:] if e[0] == "run")
    # the host waits on a batch only once the next one is enqueued (the device never waits on the host)
    for i, e in enumerate(step.log):
        if e[0] == "wait" and e[2] < len(prompt) + n_new:
            assert ("read", e[2], min(e[2] + k // 2, len(prompt) + n_new)) in step.log[:i]
    # the token sequence on the "device" holds the prompt, then every generated token
    assert step.step.states["tokens"][:len(prompt) + n_new].tolist() == prompt + gen.tokens
    stepwise = generate(CpuStep(load_plan(tiny_plan)), prompt, n_new, SamplingParams(), on_step=lambda *a: None)
    assert stepwise.tokens == gen.tokens


def test_eos_stops(tiny_plan):
    plan = load_plan(tiny_plan)
    step = TracedStep(one_token_prefill(CpuStep(plan)))
    plan.close()
    free = generate(step, [1, 2, 3], 40, SamplingParams())
    eos = free.tokens[4]
    k = free.tokens.index(eos)
    step.log.clear()
    stopped = generate(step, [1, 2, 3], 40, SamplingParams(), eos_ids={eos})
    assert stopped.tokens == free.tokens[:k + 1] and stopped.stopped_by == "eos"
    overrun = step.steps() - (3 + k)  # steps enqueued after the one that sampled the EOS
    assert 0 <= overrun <= READBACK_EVERY - 1


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", ",".join(["1"] * 250), "--max-new-tokens", "10"], "exceeds the plan's max_seq 256"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,5000"], "outside the vocabulary"),
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "a", "--prompt-ids", "1"], "exactly one of"),
    (["--prompt", "a", "--top-p", "0"], "--top-p"),
    (["--prompt", "a", "--top-k", "-1"], "--top-k"),
    (["--prompt", "a", "--min-p", "1.5"], "--min-p"),
    (["--prompt", "a", "--positions", "100"], "--positions goes with --bench or --profile"),
    (["--prompt", "a", "--profile", "--positions", "100", "--device", "cpu"], "--profile --positions runs on the GPU"),
    (["--prompt", "a", "--bench", "--profile"], "one of --bench, --profile and --verify"),
])
def test_input_errors(tiny_plan, args, message):
    r = run_cli("kestrel-run", tiny_plan, *args)
    assert r.returncode == InputError.exit_code, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_prompt_text_needs_a_tokenizer(tmp_path):
    from kestrel.compiler.build import build
    from kestrel.compiler.presets import synthesize

    ckpt = synthesize("tiny", str(tmp_path / "ckpt"))
    os.remove(os.path.join(ckpt, "tokenizer.json"))
    build(ckpt, str(tmp_path / "m.plan"), max_seq=64, log=lambda m: None, progress=False)
    r = run_cli("kestrel-run", str(tmp_path / "m.plan"), "--prompt", "hello")
    assert r.returncode == InputError.exit_code and "--prompt-ids" in r.stderr
    out = json.loads(run_cli("kestrel-run", str(tmp_path / "m.plan"), "--prompt-ids", "1,2", "--max-new-tokens", "3",
                             "--json").stdout)
    assert len(out["tokens"]) == 3 and out["text"] is None


def test_inspect(tiny_plan):
    r = run_cli("kestrelc", "inspect", tiny_plan)
    assert r.returncode == 0 and "qwen3_5_text: 4 layers (3 gated-deltanet, 1 attention)" in r.stdout
    s = json.loads(run_cli("kestrelc", "inspect", tiny_plan, "--json").stdout)
    assert s["program"]["op_counts"]["gdn_delta"] == 3 and s["program"]["op_counts"]["gdn_norm"] == 3 and s["max_seq"] == 256
    assert s["program"]["dyn_slots"]["pos"] == "i32"
    assert "mixture of experts" not in r.stdout


def test_inspect_names_the_experts(tmp_path):
    from kestrel.compiler.build import build

    path = str(tmp_path / "next.plan")
    build("tiny-next", path, max_seq=64, log=lambda m: None, progress=False)
    r = run_cli("kestrelc", "inspect", path)
    assert r.returncode == 0, r.stderr
    assert ("mixture of experts in 4 of 4 layers: 8 experts of 64, top 2 (weights renormalised), shared expert 96"
            in r.stdout)


def test_q4_weights_on_the_cpu_path_keep_codes_not_floats():
    """runtime/cpu.py weight_tensor: a q4 weight is its codes and scales (``q4``), on an [N, K] view of one NaN (no
    fp32 copy: 4 layers of the 80B-A3B shape fit this machine's memory), and products through it are
    q4_matvec_ref's; a q4 weight's values read any other way are NaN, not numbers."""
    import torch

    from kestrel.compiler.ir import TensorType, Weight
    from kestrel.kernels.matvec import matvec_ref, q4_codes, q4_matvec_ref, q4_pack
    from kestrel.kernels.moe import weight_rows
    from kestrel.runtime.cpu import weight_tensor

    n, k, group = 48, 256, 64
    buf = q4_pack(torch.randn(n, k, generator=torch.Generator().manual_seed(2)), group)
    w = weight_tensor(buf.numpy().tobytes(), Weight("w", TensorType(f"q4g{group}", (n, k))))
    assert w.shape == (n, k) and w.stride() == (0, 0) and w.untyped_storage().nbytes() == 4
    q, s = q4_codes(buf, n, k, group)
    assert torch.equal(w.q4[0], q) and torch.equal(w.q4[1], s) and w.q4[2] == group
    x = torch.randn(k, generator=torch.Generator().manual_seed(3))
    assert torch.equal(matvec_ref(x, w), q4_matvec_ref(x, q, s, group))
    part = weight_rows(w, 16, 32)  # an expert's rows (kernels/moe.py)
    assert torch.equal(matvec_ref(x, part), q4_matvec_ref(x, q[16:32], s[16:32], group))
    assert torch.isnan(w.float() @ x).all()
