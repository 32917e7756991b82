"""Text to token ids and back, from a model dir's `tokenizer.json` (the `tokenizers` library).

BOS, as transformers' fast tokenizers do it: where `tokenizer_config.json` sets
`add_bos_token`, that decides (the text is encoded without the tokenizer's own special
tokens and the BOS token prepended when it is true and the vocabulary has it); where it
is absent, `tokenizer.json`'s post-processor decides (Llama 3's adds BOS there).
"""

from __future__ import annotations

import json
import os
from typing import Any


class TextTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self.path = path
        self._tok = Tokenizer.from_file(file)
        config = _read_config(path)
        self.add_bos: bool | None = config.get("add_bos_token")
        self.bos_id = self._token_id(config.get("bos_token"))

    def _token_id(self, token: Any) -> int | None:
        """The id of a config's special token: a string, or an AddedToken's dict."""
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """NOTE: `encode_batch` runs in the library's threads without the GIL."""
        own_specials = self.add_bos is None
        encodings = self._tok.encode_batch(texts, add_special_tokens=own_specials)
        bos = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return [bos + e.ids for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}
