"""Incremental detokenization: the deltas add up to the decode of all the ids, however the
ids arrive, multi-byte characters split across tokens included; and a call's work does not
grow with the output (counted in ids handed to the decoder)."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from mpprefill.http.detokenize import (  # noqa: E402
    CONTEXT,
    MAX_HELD,
    PARTIAL_IDS,
    IncrementalDetokenizer,
)
from mpprefill.http.tokenizer import TextTokenizer  # noqa: E402
from tests.e2e.checkpoint import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TEXTS = [
    "the prefill side 😀 computes 世界 the prompt",
    "pages of keys 🇫🇷🧑‍🚀 and valüés — 日本語のテキスト travel\r\n\tend",
    "😀😀😀😀😀😀😀😀😀😀 a radix tree 한국어 ∑∫ 12 345",
]


@pytest.fixture(scope="module")
def builtin() -> TextTokenizer:
    return TextTokenizer.builtin(4096)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> TextTokenizer:
    """The byte-level BPE tokenizer trained on the checkpoint's ASCII corpus: a non-ASCII
    character is one token per byte, merges join whole words."""
    return TextTokenizer(str(save_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> TextTokenizer:
    """A SentencePiece-like tokenizer: `▁` for spaces, whose decoder drops the text's leading
    space, and bytes of characters outside its vocabulary as `<0xNN>` tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for c in "▁" + string.ascii_letters + string.digits + ".,!?-":
        vocab[c] = len(vocab)
    models = tokenizers.models
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace("▁", prepend_scheme="first")
    d = tokenizers.decoders
    tok.decoder = d.Sequence([d.Replace("▁", " "), d.ByteFallback(), d.Fuse(), d.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    path = tmp_path_factory.mktemp("sp")
    tok.save(str(path / "tokenizer.json"))
    return TextTokenizer(str(path))


@pytest.fixture(params=["builtin", "trained", "sentencepiece"])
def tokenizer(request) -> TextTokenizer:
    return request.getfixturevalue(request.param)


def _deltas(tok, ids: list[int], sizes: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out = []
    at = 0
    for size in sizes:
        out.append(detok.add(ids[at : at + size]))
        at += size
    out.append(detok.add(ids[at:]))
    out.append(detok.flush())
    assert detok.text == "".join(out)
    return out


def _decode_stream(tok, ids: list[int]) -> str:
    """The library's own streaming decoder, a second reference."""
    stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
    return "".join(stream.step(tok._tok, i) or "" for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_one_id_at_a_time_adds_up_to_the_whole_decode(tokenizer, text):
    [ids] = tokenizer.encode([text])
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # split characters
    deltas = _deltas(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids) == text == _decode_stream(tokenizer, ids)
    assert not any("\ufffd" in d for d in deltas)
    if tokenizer.path is None:  # one byte a token: each character comes out when whole
        assert [d for d in deltas if d] == list(text)


@pytest.mark.parametrize("sizes", [[2] * 60, [3, 7, 1, 11, 5] * 10, [40, 1, 1, 1], [200]])
def test_any_chunking_adds_up_to_the_whole_decode(tokenizer, sizes):
    for text in TEXTS:
        [ids] = tokenizer.encode([text])
        deltas = _deltas(tokenizer, ids, sizes)
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=150, deadline=None)
@given(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd")),
    st.lists(st.integers(1, 20), max_size=40),
)
def test_builtin_arbitrary_text_and_chunks(builtin, text, sizes):
    [ids] = builtin.encode([text])
    assert "".join(_deltas(builtin, ids, sizes)) == text


def test_a_long_call_ending_mid_character_emits_up_to_the_last_whole_one(builtin):
    ids = list(("ab" + "😀" * 5).encode())
    assert len(ids) - 2 > MAX_HELD
    detok = IncrementalDetokenizer(builtin)
    assert detok.add(ids[:-2]) == "ab" + "😀" * 4
    assert detok.add(ids[-2:-1]) == ""
    assert detok.add(ids[-1:]) == "😀"


def test_a_run_of_invalid_bytes_is_not_held_forever(builtin):
    ids = [0xFF] * (MAX_HELD + 3) + list("a😀".encode())
    detok = IncrementalDetokenizer(builtin)
    deltas = [detok.add([i]) for i in ids]
    assert "\ufffd" * (MAX_HELD + 1) in deltas[: MAX_HELD + 1]
    assert "".join(deltas) + detok.flush() == builtin.decode(ids) == "\ufffd" * 11 + "a😀"


def test_specials_skipped_or_kept(builtin):
    [ids] = builtin.encode(["<|im_start|>assistant\n😀 hi<|im_end|>"], add_special_tokens=False)
    for skip in (True, False):
        deltas = _deltas(builtin, ids, [1] * len(ids), skip=skip)
        assert "".join(deltas) == builtin.decode(ids, skip_special_tokens=skip)
    assert "".join(_deltas(builtin, ids, [1] * len(ids), skip=False)).startswith("<|im_start|>")


def test_a_cut_character_is_flushed_as_the_whole_decode_shows_it(tokenizer):
    [ids] = tokenizer.encode(["ok 😀"], add_special_tokens=False)
    cut = ids[:-2]
    detok = IncrementalDetokenizer(tokenizer)
    held = [detok.add([i]) for i in cut]
    assert "".join(held) == "ok "
    tail = tokenizer.decode(cut)[len("ok ") :]
    assert tail and set(tail) == {"\ufffd"}  # one per byte or one per character
    assert detok.flush() == tail
    assert detok.flush() == ""


class _CountingDecoder:
    """A tokenizer that counts the ids handed to its decode."""

    def __init__(self, tok: TextTokenizer):
        self.tok = tok
        self.ids = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_is_flat_over_a_long_stream(tokenizer):
    text = " ".join(TEXTS) * 40
    [ids] = tokenizer.encode([text])
    ids = ids[:4000]
    assert len(ids) == 4000
    counting = _CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(counting)
    work = []
    for i in ids:
        before = counting.ids
        detok.add([i])
        work.append(counting.ids - before)
    assert detok.text + detok.flush() == tokenizer.decode(ids)
    # A few decodes of at most a window each, wherever in the stream.
    assert max(work) <= (2 + PARTIAL_IDS) * (CONTEXT + 2 * MAX_HELD + 1)
    assert sum(work[-1000:]) <= sum(work[:1000]) * 1.1
    assert sum(work) <= 2 * (CONTEXT + 2) * len(ids)
