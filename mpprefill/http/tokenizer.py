"""Text to token ids and back, from a model dir's `tokenizer.json` (the `tokenizers` library),
or the built-in byte-level tokenizer of the built-in model.

BOS, as transformers' fast tokenizers do it: where `tokenizer_config.json` sets
`add_bos_token`, that decides (the text is encoded without the tokenizer's own special
tokens and the BOS token prepended when it is true and the vocabulary has it); where it
is absent, `tokenizer.json`'s post-processor decides (Llama 3's adds BOS there). Encoding
with `add_special_tokens=False` adds neither, as a rendered chat prompt needs: its template
wrote the BOS already.

The built-in tokenizer: token `b` is byte `b` (0..255), then the special tokens of
BUILTIN_SPECIALS, then `<|reserved_N|>` tokens up to the model's vocabulary, so that every
id the model can sample decodes. The reserved ones are plain tokens, not special: decoding
with `skip_special_tokens` keeps them, so a built-in model's output (its weights are
random) reads as text rather than as nothing. Its post-processor prepends `<|bos|>`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

BUILTIN_BOS = "<|bos|>"
BUILTIN_EOS = "<|eos|>"
BUILTIN_SPECIALS = (BUILTIN_BOS, BUILTIN_EOS, "<|im_start|>", "<|im_end|>")
# The built-in chat template: ChatML after BOS; a message's content is a string or a list of
# OpenAI content parts, of which the text parts count.
BUILTIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is defined %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# What a tokenizer_config.json of the built-in tokenizer would hold.
BUILTIN_CONFIG: dict[str, Any] = {
    "bos_token": BUILTIN_BOS,
    "eos_token": BUILTIN_EOS,
    "chat_template": BUILTIN_CHAT_TEMPLATE,
}


class TextTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        self._setup(Tokenizer.from_file(file), path, read_config(path))

    @classmethod
    def builtin(cls, vocab_size: int) -> TextTokenizer:
        """The built-in model's byte-level tokenizer over `vocab_size` ids; `path` is None."""
        tok = cls.__new__(cls)
        tok._setup(builtin_tokenizer(vocab_size), None, BUILTIN_CONFIG)
        return tok

    def _setup(self, tok: Any, path: str | None, config: dict[str, Any]) -> None:
        self.path = path
        self._tok = tok
        self.add_bos: bool | None = config.get("add_bos_token")
        self.bos_id = self._token_id(config.get("bos_token"))
        self.eos_token_id = self._token_id(config.get("eos_token"))

    def _token_id(self, token: Any) -> int | None:
        """The id of a config's special token: a string, or an AddedToken's dict."""
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: its longest vocabulary string
        (added tokens too). A byte-level token's string has one character per byte, and a
        character is at least one byte, so no token covers more characters than this."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """NOTE: `encode_batch` runs in the library's threads without the GIL."""
        own_specials = add_special_tokens and self.add_bos is None
        encodings = self._tok.encode_batch(texts, add_special_tokens=own_specials)
        add_bos = add_special_tokens and self.add_bos and self.bos_id is not None
        bos = [self.bos_id] if add_bos else []
        return [bos + e.ids for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def builtin_tokenizer(vocab_size: int) -> Any:
    """The built-in byte-level `tokenizers.Tokenizer` (see the module's docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = len(BUILTIN_SPECIALS)
    if vocab_size < 256 + specials:
        raise ValueError(f"vocab_size {vocab_size} < {256 + specials}: 256 bytes and the specials")
    chars = byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - specials)]
    tok.add_special_tokens(list(BUILTIN_SPECIALS))
    tok.add_tokens(reserved)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BUILTIN_BOS} $A",
        pair=f"{BUILTIN_BOS} $A {BUILTIN_BOS} $B",
        special_tokens=[(BUILTIN_BOS, tok.token_to_id(BUILTIN_BOS))],
    )
    return tok


def byte_chars() -> list[str]:
    """The byte-level alphabet: byte `b` is written as the character `byte_chars()[b]`;
    printable Latin-1 bytes as themselves, the others as the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    for b in printable:
        chars[b] = chr(b)
    others = [b for b in range(256) if b not in printable]
    for n, b in enumerate(others):
        chars[b] = chr(0x100 + n)
    return chars


def read_config(path: str) -> dict[str, Any]:
    """A model dir's tokenizer_config.json ({} where it has none)."""
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}
