"""The tokenizer wrapper: BOS from tokenizer_config.json, or from tokenizer.json's own
post-processor where the config does not say."""

from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers")

from mpprefill.http.tokenizer import TextTokenizer  # noqa: E402

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


def test_decode_skips_special_tokens_unless_told(tmp_path):
    tok = TextTokenizer(_save(tmp_path, None))
    assert tok.decode([1, 3, 4]) == "hello world"
    assert tok.decode([1, 3], skip_special_tokens=False) == "<s> hello"


def test_a_dir_without_tokenizer_json_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        TextTokenizer(str(tmp_path))
