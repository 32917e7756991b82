"""Fixtures of the HTTP front's tests: one serve and its fronts per pytest process, shared by
the files that use them (each test leaves the server idle), always stopped."""

from __future__ import annotations

import json

import pytest

from tests.http.helpers import Front
from tests.reliability.helpers import Serve

CONTEXT_LENGTH = 64
BODY_LIMIT = 64 << 10
VOCAB = 4096  # ModelConfig.tiny().vocab_size, checked in the tests
SPECIALS = ["<unk>", "<s>", "</s>"]


@pytest.fixture(scope="session")
def serve():
    s = Serve.start(
        *("--forward-mode", "normal", "--context-length", str(CONTEXT_LENGTH)),
        *("--worker-threads", "1", "--log-level", "warning"),
    )
    yield s
    s.kill()


@pytest.fixture(scope="session")
def ids_front(serve):
    """A front without a tokenizer (the built-in model has none)."""
    front = Front.start(serve.port, "--max-body-bytes", str(BODY_LIMIT))
    yield front
    front.kill()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer over the tiny model's whole vocabulary: `w5` is token 5,
    `<s>` (1) its BOS, prepended as its tokenizer_config.json says."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIALS), VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(path / "tokenizer.json"))
    config = {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def text_front(serve, tokenizer_dir):
    front = Front.start(serve.port, "--tokenizer-path", str(tokenizer_dir))
    yield front
    front.kill()
