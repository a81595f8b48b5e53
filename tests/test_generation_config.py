"""generation_config.json's stop tokens (what transformers' generate and vLLM stop at: Qwen's instruct releases list
<|im_end|> there beside config.json's <|endoftext|>) join the plan's, so `kestrel-run --prompt` stops there too; its
recommended sampling (with do_sample) is kestrel-run's default for the options not given, as vLLM's for a request."""
import json
import os
import shutil

import pytest

from conftest import run_cli
from kestrel.artifacts.errors import ConfigError
from kestrel.compiler.presets import synthesize


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return synthesize("tiny", str(tmp_path_factory.mktemp("tiny")))


def _run(plan, n=8):
    r = run_cli("kestrel-run", plan, "--prompt", "Hello", "--max-new-tokens", str(n), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generation_config_stop_tokens_end_a_run(tiny_folder, tmp_path):
    plain = str(tmp_path / "plain.plan")
    assert run_cli("kestrelc", "build", tiny_folder, "-o", plain).returncode == 0
    free = _run(plain)
    assert free["stopped_by"] == "max_tokens" and len(free["tokens"]) == 8
    stop = free["tokens"][2]  # the third new token, made a stop token (one not among the first two)
    assert stop not in free["tokens"][:2]
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tiny_folder, ckpt)
    json.dump({"eos_token_id": [stop, 256]}, open(os.path.join(ckpt, "generation_config.json"), "w"))
    plan = str(tmp_path / "gen.plan")
    assert run_cli("kestrelc", "build", ckpt, "-o", plan).returncode == 0
    from kestrel.artifacts.plan import load_plan
    p = load_plan(plan)
    assert p.manifest["tokenizer"]["eos_token_ids"] == [256, stop]  # config.json's first, then generation_config's
    p.close()
    got = _run(plan)
    assert got["stopped_by"] == "eos" and got["tokens"] == free["tokens"][:3] and got["temperature"] == 0


@pytest.mark.parametrize("gen, message", [({"eos_token_id": 5000}, "eos_token_id 5000 is outside the vocabulary"),
                                          ({"eos_token_id": "x"}, "'eos_token_id' must be a token id or a list")])
def test_bad_generation_config_is_refused_in_one_line(gen, message, tiny_folder, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tiny_folder, ckpt)
    json.dump(gen, open(os.path.join(ckpt, "generation_config.json"), "w"))
    r = run_cli("kestrelc", "build", ckpt, "-o", str(tmp_path / "m.plan"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == ConfigError.exit_code and len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "m.plan").exists()


def test_an_empty_stop_list_adds_none(tiny_folder, tmp_path):
    from kestrel.compiler.frontend import read_generation_config

    json.dump({"eos_token_id": []}, open(tmp_path / "generation_config.json", "w"))
    assert read_generation_config(str(tmp_path)) == ((), {})
    json.dump({"eos_token_id": None, "temperature": 0.6}, open(tmp_path / "generation_config.json", "w"))
    assert read_generation_config(str(tmp_path)) == ((), {})


def test_recommended_sampling_is_the_default_for_options_not_given(tiny_folder, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tiny_folder, ckpt)
    json.dump({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
              open(os.path.join(ckpt, "generation_config.json"), "w"))
    plan = str(tmp_path / "gen.plan")
    assert run_cli("kestrelc", "build", ckpt, "-o", plan).returncode == 0
    assert "sampling  temperature 0.7, top-p 0.8, top-k 20" in run_cli("kestrelc", "inspect", plan).stdout
    args = ["kestrel-run", plan, "--prompt", "Hello", "--max-new-tokens", "12", "--seed", "3"]
    r = run_cli(*args)
    assert r.returncode == 0 and "note: sampling as the model's generation_config.json recommends (temperature 0.7, " \
        "top-p 0.8, top-k 20); --temperature 0 for greedy" in r.stderr, r.stderr
    default = json.loads(run_cli(*args, "--json").stdout)
    explicit = json.loads(run_cli(*args, "--json", "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20").stdout)
    greedy = json.loads(run_cli(*args, "--json", "--temperature", "0").stdout)
    assert default["temperature"] == 0.7 and default["tokens"] == explicit["tokens"] != greedy["tokens"]
    assert greedy["temperature"] == 0
    mixed = json.loads(run_cli(*args, "--json", "--top-k", "1").stdout)  # top-k 1 given: the rest recommended
    assert mixed["temperature"] == 0.7 and mixed["tokens"] == greedy["tokens"]


@pytest.mark.parametrize("gen, sampling", [({"do_sample": False, "temperature": 0.7}, {}),  # greedy, as generate
                                           ({"temperature": 0.7}, {}),
                                           ({"do_sample": True, "top_k": 20, "min_p": 0}, {"top_k": 20, "min_p": 0.0})])
def test_sampling_is_taken_only_with_do_sample(gen, sampling, tmp_path):
    from kestrel.compiler.frontend import read_generation_config

    json.dump(gen, open(tmp_path / "generation_config.json", "w"))
    assert read_generation_config(str(tmp_path)) == ((), sampling)


def test_bad_recommended_sampling_is_refused(tmp_path):
    from kestrel.compiler.frontend import read_generation_config

    json.dump({"do_sample": True, "top_p": 1.5}, open(tmp_path / "generation_config.json", "w"))
    with pytest.raises(ConfigError, match="'top_p' must be a number in \\(0, 1\\], got 1.5"):
        read_generation_config(str(tmp_path))
