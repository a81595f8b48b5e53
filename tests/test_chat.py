"""--chat: the checkpoint's chat template rendered as transformers renders it, stored in the plan by the
build, applied by kestrel-run; interactive turns that continue the model's state give the tokens a
fresh run of the whole conversation gives."""
import json
import os

import pytest

from conftest import run_cli
from kestrel.runtime.chat import ChatTemplate

# A ChatML template in the style of the Qwen family's: a default system turn, tool calls through tojson,
# loop controls, and the generation prompt.
CHATML = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|im_start|>assistant\\n' }}
        {%- for call in message.tool_calls %}
        {{- '<tool_call>' + call | tojson + '</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Grüße <b>&</b>  "},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "tool_calls": [{"name": "get", "arguments": {"city": "Zürich", "n": 1}}]},
     {"role": "user", "content": "thanks"}],
]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_rendering_matches_transformers(i, gen_prompt):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from kestrel.compiler.presets import byte_level_tokenizer_json

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_level_tokenizer_json()),
                                 eos_token="<|im_end|>")
    hf.chat_template = CHATML
    want = hf.apply_chat_template(CONVERSATIONS[i], tokenize=False, add_generation_prompt=gen_prompt)
    got = ChatTemplate(CHATML, {"eos_token": "<|im_end|>"}).render(CONVERSATIONS[i], add_generation_prompt=gen_prompt)
    assert got == want


@pytest.fixture(scope="module")
def chat_plan(tmp_path_factory):
    from kestrel.compiler.presets import synthesize

    folder = synthesize("tiny", str(tmp_path_factory.mktemp("chat-ckpt")))
    json.dump({"chat_template": CHATML, "eos_token": {"content": "<|im_end|>"}},
              open(os.path.join(folder, "tokenizer_config.json"), "w"))
    plan = str(tmp_path_factory.mktemp("chat") / "chat.plan")
    r = run_cli("kestrelc", "build", folder, "-o", plan, "--max-seq", "512", "--quiet")
    assert r.returncode == 0, r.stderr
    return plan


def test_the_plan_carries_the_template_and_a_turn_uses_it(chat_plan, tiny_plan):
    from kestrel.artifacts.plan import load_plan

    tok = load_plan(chat_plan).manifest["tokenizer"]
    assert tok["chat_template"] == CHATML and tok["special_tokens"] == {"eos_token": "<|im_end|>"}
    r = run_cli("kestrel-run", chat_plan, "--chat", "--system", "Be brief.", "--prompt", "Hi", "--max-new-tokens", "4",
                "--json")
    assert r.returncode == 0, r.stderr
    rendered = ChatTemplate(CHATML, {}).render([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi"}])
    assert json.loads(r.stdout)["prompt_tokens"] == len(rendered.encode())  # byte-level: one token a byte
    r = run_cli("kestrel-run", tiny_plan, "--chat", "--prompt", "Hi")
    assert r.returncode == 6 and "no chat template" in r.stderr


def test_interactive_turns_equal_fresh_runs_of_the_conversation(chat_plan):
    """Each turn's tokens (the state continued from the turns before) equal a fresh greedy run of the
    whole conversation so far, rendered the same way."""
    from kestrel.artifacts.plan import load_plan
    from kestrel.runtime.cpu import CpuStep
    from kestrel.runtime.generate import SamplingParams, generate
    from kestrel.runtime.tokenizer import PlanTokenizer

    turns = ["Hello there", "And again"]
    r = run_cli("kestrel-run", chat_plan, "--chat", "--max-new-tokens", "6", "--json", stdin="\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["turn"] for o in out] == [0, 1]
    plan = load_plan(chat_plan)
    tok, template = PlanTokenizer(plan.tokenizer_json), ChatTemplate.from_manifest(plan.manifest)
    messages = []
    for turn, o in zip(turns, out):
        messages.append({"role": "user", "content": turn})
        ids = tok.encode(template.render(messages))
        fresh = generate(CpuStep(plan), ids, 6, SamplingParams(), eos_ids={tok.token_id("<|im_end|>")})
        assert o["tokens"] == fresh.tokens and o["prompt_tokens"] == len(ids)
        messages.append({"role": "assistant", "content": o["text"]})


def test_resumed_generation_equals_a_fresh_one(tiny_plan):
    """The step's state after one request, continued with more prompt tokens (resume_from), gives
    the tokens and logits a fresh request over the whole sequence gives."""
    from kestrel.artifacts.plan import load_plan
    from kestrel.runtime.cpu import CpuStep
    from kestrel.runtime.generate import SamplingParams, generate

    plan = load_plan(tiny_plan)
    first, more = [72, 105, 32, 116, 104], [101, 114, 101]
    step = CpuStep(plan)
    g1 = generate(step, first, 5, SamplingParams(), on_step=lambda *a: None)
    seq = first + g1.tokens[:-1] + more  # the last sampled token was never fed back; the next turn follows
    g2 = generate(step, seq, 6, SamplingParams(), on_step=lambda *a: None, resume_from=len(first) + len(g1.tokens) - 1)
    logits_resumed = step.output("logits")
    fresh_step = CpuStep(plan)
    g3 = generate(fresh_step, seq, 6, SamplingParams(), on_step=lambda *a: None)
    assert g2.tokens == g3.tokens
    assert (logits_resumed == fresh_step.output("logits")).all()
