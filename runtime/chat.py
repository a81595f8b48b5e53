"""Chat templates: a checkpoint's own ``chat_template`` (tokenizer_config.json or chat_template.jinja,
stored in the plan's manifest by the compiler), rendered the way Hugging Face transformers renders it
(``apply_chat_template``): a sandboxed jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``,
the loop-controls extension, a ``tojson`` filter that does not escape HTML, ``raise_exception`` and
``strftime_now``, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables.
tests/test_chat.py checks the rendering against transformers on templates of the Qwen family.
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kestrel.artifacts.errors import ArtifactError, InputError


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise ArtifactError(f"the plan's chat template does not parse ({e}); rebuild from a checkpoint whose "
                                f"tokenizer_config.json has a valid chat_template") from None
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_manifest(cls, manifest: dict) -> "ChatTemplate":
        tok = manifest.get("tokenizer", {})
        if not tok.get("chat_template"):
            raise InputError("this plan has no chat template (its checkpoint's tokenizer_config.json had no "
                             "chat_template): use --prompt without --chat")
        return cls(tok["chat_template"], tok.get("special_tokens", {}))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template refused the conversation: {e}") from None
