"""Speculative sampling and controlled acceptance end to end on the CPU path (tiny-mtp, K = 3):

  * at temperature > 0 a speculative plan now speculates: deterministic per seed, and the first token the
    iteration decides (after the prefill's sampled one) follows the plain sampler's distribution p at that
    position (chi-square over 160 seeds against the per-seed p, the MTP head's random drafts being mostly
    rejected, so the residual draw is what is tested);
  * ``--draft-source replay:FILE --draft-accept A``: the output is the replayed run's tokens whatever A,
    acceptance 3.00 at A = 1 and 0.00 at A = 0, near sum A^i between; ``--json`` labels the figures; the
    user errors (a file missing, for another prompt, a plan without speculation, a list without --bench)."""
import json
import math

import pytest
import torch
from click.testing import CliRunner

from kestrel.artifacts.plan import load_plan
from kestrel.compiler.build import build
from kestrel.kernels.speculative import filtered_probs_ref
from kestrel.runtime import cli
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.generate import Replay, SamplingParams, expected_accepted, generate

PROMPT = [5, 17, 42]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec_e2e") / "k3.plan")
    build("tiny-mtp", path, max_seq=64, prefill_rows=8, speculative="mtp", draft_tokens=3, log=lambda m: None,
          progress=False)
    return path


@pytest.fixture(scope="module")
def steps(plan):
    p = load_plan(plan)
    spec, plain = CpuStep(p), CpuStep(p)
    p.close()
    plain.spec_k = 0
    return spec, plain


def test_sampled_speculation_is_deterministic_per_seed(steps):
    spec, plain = steps
    s = SamplingParams(temperature=0.8, top_p=0.9, seed=3, top_k=40)
    a, b = generate(spec, PROMPT, 16, s), generate(spec, PROMPT, 16, s)
    assert a.tokens == b.tokens and a.draft_tokens == 3 and a.spec_iterations > 0
    c = generate(spec, PROMPT, 16, SamplingParams(temperature=0.8, top_p=0.9, seed=4, top_k=40))
    assert c.tokens != a.tokens
    assert a.tokens[0] == generate(plain, PROMPT, 1, s).tokens[0]  # the prefill's token: the plain sampler's
    spec.spec_sampling = False  # a plan built before speculative sampling: sampled requests decode plainly
    try:
        old = generate(spec, PROMPT, 16, s)
    finally:
        spec.spec_sampling = True
    assert old.draft_tokens == 0 and old.tokens == generate(plain, PROMPT, 16, s).tokens


def test_first_speculative_token_follows_the_plain_distribution(steps):
    """Over 160 seeds: the speculative prefill (it samples token n and drafts n + 1 .. n + 3 from q), then
    one iteration; the token it decides at n + 1 against the mixture of the per-seed p there (p from the
    iteration's own verify logits, row 0), Pearson's chi-square at alpha 0.001 over the categories
    expected >= 5 (the rest pooled). The same test rejects what "always accept" would have emitted on
    the same runs (the drafts at n + 1): it has power against a biased acceptance."""
    spec, plain = steps
    filt = dict(temperature=1.0, top_p=1.0, top_k=6, min_p=0.0)
    n, v = len(PROMPT), 320
    expected, got, drafted = torch.zeros(v, dtype=torch.float64), torch.zeros(v), torch.zeros(v)
    rejected = 0
    for seed in range(160):
        spec.begin(PROMPT, filt["temperature"], filt["top_p"], seed, top_k=filt["top_k"], min_p=filt["min_p"])
        spec.run_spec_prefill(1)
        d0 = int(spec.states["tokens"][n + 1])
        spec.run_spec(1)
        logits = spec.outputs["logits"][0]
        expected += filtered_probs_ref(logits, filt["temperature"], filt["top_p"], filt["top_k"], filt["min_p"]).double()
        got[int(spec.states["tokens"][n + 1])] += 1
        drafted[d0] += 1
        rejected += int(spec.dyn["accepted"]) == 0
    assert rejected > 60  # the residual draw is exercised

    def chi2(counts):
        big = expected >= 5
        e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
        o = torch.cat([counts[big].double(), counts[~big].sum().reshape(1).double()])
        keep = e > 0
        stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
        df = int(keep.sum()) - 1
        crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
        return stat, crit

    stat, crit = chi2(got)
    assert stat < crit, (stat, crit)
    stat, crit = chi2(drafted)
    assert stat > crit, (stat, crit)


def test_replay_sets_acceptance_and_reproduces_the_run(steps):
    spec, plain = steps
    ref = generate(plain, PROMPT, 30, SamplingParams())
    seq = PROMPT + ref.tokens
    for a in (0.0, 0.5, 1.0):
        its = acc = 0
        for seed in range(3 if a == 0.5 else 1):
            g = generate(spec, PROMPT, 30, SamplingParams(seed=seed), replay=Replay(seq, a))
            assert g.tokens == ref.tokens
            its, acc = its + g.spec_iterations, acc + g.spec_accepted
        mean = acc / its
        if a in (0.0, 1.0):
            assert mean == 3 * a
        else:
            assert abs(mean - expected_accepted(a, 3)) < 0.35, mean
    g = generate(spec, PROMPT, 30, SamplingParams(seed=1))  # the next request replays nothing
    assert g.spec_accepted == 0 or g.accepted_per_step < 3


def _run(*args):
    r = CliRunner().invoke(cli.command, list(args))
    return r.exit_code, r.output


def test_kestrel_run_replay_json_and_errors(plan, tiny_plan, tmp_path):
    code, out = _run(plan, "--prompt-ids", "5,17,42", "--max-new-tokens", "12", "--json")
    assert code == 0, out
    run = json.loads(out)
    assert run["prompt_ids"] == PROMPT and run["temperature"] == 0 and run["controlled_acceptance"] is None
    assert run["draft_tokens"] == 3 and run["accepted_per_step"] is not None
    f = tmp_path / "run.json"
    f.write_text(out)
    code, out = _run(plan, "--prompt-ids", "5,17,42", "--max-new-tokens", "12", "--json", "--draft-source",
                     f"replay:{f}", "--draft-accept", "1")
    assert code == 0, out
    r = json.loads(out)
    assert r["tokens"] == run["tokens"] and r["accepted_per_step"] == 3.0
    c = r["controlled_acceptance"]
    assert c["label"].startswith("controlled-acceptance") and c["draft_accept"] == 1 and c["tokens_equal_replay"]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(run, prompt_ids=[5, 17, 43])))
    sampled = tmp_path / "sampled.json"
    sampled.write_text(json.dumps(dict(run, temperature=0.7)))
    for args, code_want, text in [
            ([plan, "--draft-source", f"replay:{tmp_path / 'missing.json'}"], 13, "cannot be read"),
            ([plan, "--draft-source", f"replay:{other}"], 13, "another prompt"),
            ([plan, "--draft-source", f"replay:{sampled}"], 13, "a sampled run"),
            ([tiny_plan, "--draft-source", f"replay:{f}"], 13, "rebuild it with --speculative mtp"),
            ([plan, "--draft-source", f"replay:{f}", "--max-new-tokens", "13"], 13, "lower --max-new-tokens"),
            ([plan, "--draft-source", f"replay:{f}", "--draft-accept", "0,1"], 6, "a list goes with --bench"),
            ([plan, "--draft-source", f"replay:{f}", "--draft-accept", "1.5"], 6, "in [0, 1]"),
            ([plan, "--draft-accept", "1"], 6, "goes with --draft-source"),
            ([plan, "--draft-source", "head"], 6, "mtp"),
            ([plan, "--draft-source", f"replay:{f}", "--bench"], 6, "run on the GPU")]:
        code, out = _run(*args[:1], "--prompt-ids", "5,17,42", *args[1:])
        assert code == code_want and text in out and out.count("\n") == 1, (args, code, out)
