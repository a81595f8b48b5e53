"""Text <-> token ids for a plan, through the tokenizers library (the plan stores a tokenizer.json)."""
from __future__ import annotations

from tokenizers import Tokenizer

from kestrel.artifacts.errors import ArtifactError, InputError


class PlanTokenizer:
    def __init__(self, tokenizer_json: str | None):
        self._tok = None
        if tokenizer_json is not None:

            try:
                self._tok = Tokenizer.from_str(tokenizer_json)
            except Exception as e:  # the library raises plain Exception subclasses
                raise ArtifactError(f"the plan's tokenizer cannot be loaded ({e}); rebuild the plan") from None

    def encode(self, text: str) -> list[int]:
        if self._tok is None:
            raise InputError("this plan has no tokenizer (its checkpoint had no tokenizer.json): "
                             "pass --prompt-ids instead of --prompt")
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, text: str | None) -> int | None:
        """The id of a token given as its text (a special token such as ``<|im_end|>``), or None."""
        return None if self._tok is None or text is None else self._tok.token_to_id(text)

    def decode(self, ids: list[int]) -> str | None:
        return None if self._tok is None else self._tok.decode(ids, skip_special_tokens=True)
