"""The tokenizer wrapper: BOS from tokenizer_config.json, or from tokenizer.json's own
post-processor where the config does not say, none with add_special_tokens=False; and the
built-in byte-level tokenizer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from mpprefill.http.tokenizer import (  # noqa: E402
    BUILTIN_SPECIALS,
    TextTokenizer,
    builtin_tokenizer,
    byte_chars,
)
from mpprefill.model.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.timeout(60)
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}


def _save(path, config: dict | None, post_bos: bool = False) -> str:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    if post_bos:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("config", "post_bos", "ids"),
    [
        ({"add_bos_token": True, "bos_token": "<s>"}, False, [1, 3, 4]),
        ({"add_bos_token": True, "bos_token": {"content": "<s>"}}, False, [1, 3, 4]),
        ({"add_bos_token": False, "bos_token": "<s>"}, True, [3, 4]),
        ({"add_bos_token": True, "bos_token": "<nope>"}, False, [3, 4]),
        (None, True, [1, 3, 4]),
        (None, False, [3, 4]),
    ],
)
def test_bos_as_configured(tmp_path, config, post_bos, ids):
    tok = TextTokenizer(_save(tmp_path, config, post_bos))
    assert tok.encode(["hello world"]) == [ids]


@pytest.mark.parametrize(
    ("config", "post_bos"),
    [({"add_bos_token": True, "bos_token": "<s>"}, False), (None, True), (None, False)],
)
def test_no_special_tokens_means_no_bos(tmp_path, config, post_bos):
    tok = TextTokenizer(_save(tmp_path, config, post_bos))
    assert tok.encode(["hello world"], add_special_tokens=False) == [[3, 4]]


def test_eos_token_id_from_the_config(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = {"eos_token": {"content": "</s>"}}
    assert TextTokenizer(_save(tmp_path / "a", config)).eos_token_id == 2
    assert TextTokenizer(_save(tmp_path / "b", None)).eos_token_id is None


def test_decode_skips_special_tokens_unless_told(tmp_path):
    tok = TextTokenizer(_save(tmp_path, None))
    assert tok.decode([1, 3, 4]) == "hello world"
    assert tok.decode([1, 3], skip_special_tokens=False) == "<s> hello"


def test_a_dir_without_tokenizer_json_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        TextTokenizer(str(tmp_path))


@pytest.fixture(scope="module")
def builtin() -> TextTokenizer:
    return TextTokenizer.builtin(ModelConfig().vocab_size)


def test_builtin_spans_the_model_vocabulary(builtin):
    assert builtin.path is None
    assert builtin.vocab_size == ModelConfig().vocab_size == 4096
    assert builtin.eos_token_id == 257
    assert builtin.decode([builtin.eos_token_id], skip_special_tokens=False) == "<|eos|>"
    # Every id the model can sample decodes: the ids past the specials are reserved ones.
    assert builtin.decode([4095], skip_special_tokens=False) == "<|reserved_3835|>"
    # ... and reads as text: the reserved ids are not special
    assert builtin.decode([104, 4095, 257]) == "h<|reserved_3835|>"


def test_builtin_alphabet_is_the_byte_level_one():
    assert sorted(byte_chars()) == sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert byte_chars()[ord("a")] == "a"


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",))))
def test_builtin_ids_are_the_utf8_bytes_after_bos(builtin, text):
    [ids] = builtin.encode([text])
    assert ids == [256, *text.encode("utf-8")]
    assert builtin.encode([text], add_special_tokens=False) == [ids[1:]]
    assert builtin.decode(ids) == text


def test_builtin_specials_are_single_tokens(builtin):
    text = "<|im_start|>user\nhi<|im_end|>"
    [ids] = builtin.encode([text], add_special_tokens=False)
    assert ids == [258, *b"user\nhi", 259]
    assert builtin.decode(ids, skip_special_tokens=False) == text
    assert builtin.decode(ids) == "user\nhi"


def test_builtin_needs_room_for_bytes_and_specials():
    assert builtin_tokenizer(256 + len(BUILTIN_SPECIALS)).get_vocab_size() == 260
    with pytest.raises(ValueError, match="vocab_size"):
        TextTokenizer.builtin(256 + len(BUILTIN_SPECIALS) - 1)
