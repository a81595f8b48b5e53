"""generation_config.json's stop tokens (what transformers' generate and vLLM stop at: Qwen's instruct releases list
<|im_end|> there beside config.json's <|endoftext|>) join the plan's, so `kestrel-run --prompt` stops there too."""
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
    json.dump({"eos_token_id": [stop, 256], "do_sample": True, "temperature": 0.7},
              open(os.path.join(ckpt, "generation_config.json"), "w"))
    plan = str(tmp_path / "gen.plan")
    assert run_cli("kestrelc", "build", ckpt, "-o", plan).returncode == 0
    from kestrel.artifacts.plan import load_plan
    p = load_plan(plan)
    assert p.manifest["tokenizer"]["eos_token_ids"] == [256, stop]  # config.json's first, then generation_config's
    p.close()
    got = _run(plan)
    assert got["stopped_by"] == "eos" and got["tokens"] == free["tokens"][:3]
    assert got["temperature"] == 0  # only the stop tokens are taken: sampling stays what the command line says


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
    from kestrel.compiler.frontend import read_generation_eos

    json.dump({"eos_token_id": []}, open(tmp_path / "generation_config.json", "w"))
    assert read_generation_eos(str(tmp_path)) == ()
    json.dump({"eos_token_id": None, "temperature": 0.6}, open(tmp_path / "generation_config.json", "w"))
    assert read_generation_eos(str(tmp_path)) == ()
