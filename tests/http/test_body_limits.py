"""Bodies are bounded before they are parsed, and texts before they are tokenized: a body
over --max-body-bytes (strictly: the limit itself is allowed) is 413 from its
Content-Length or as soon as its streamed bytes pass the limit, a text longer than the
context could hold is 400 unencoded, and the front's memory after refused bodies is its
idle size."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterable

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")

from mpprefill.http.args import HttpArgs  # noqa: E402
from tests.http.conftest import BODY_LIMIT, CONTEXT_LENGTH  # noqa: E402
from tests.http.helpers import Front  # noqa: E402

pytestmark = pytest.mark.timeout(240)
DEFAULT_LIMIT = HttpArgs().max_body_bytes
# the conftest's word-level tokenizer: its longest tokens ("w4095", "<unk>") are 5 characters,
# and a dropped space may sit between two tokens
MAX_TEXT_CHARS = CONTEXT_LENGTH * (5 + 1)
MIB = 1 << 20
ONE = {"max_new_tokens": 1}
# half the default limit: one buffer of the limit's size kept would be over it
RSS_MARGIN_KIB = DEFAULT_LIMIT // 2048


def test_the_default_limit_holds_a_batch_of_long_prompts_as_input_ids():
    """16 prompts of 128k six-digit ids, as json.dumps writes them, fit the default."""
    batch = {"input_ids": [[128255] * 131072] * 16, "sampling_params": {"max_new_tokens": 1}}
    assert len(json.dumps(batch).encode()) <= DEFAULT_LIMIT


def _post(port: int, head: dict[str, str], body: Iterable[bytes]) -> tuple[int, bytes]:
    """POST /generate, sending `body` on a thread while the reply is read: a front that
    answers before it read the body must not leave the sender blocked."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    lines = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in head.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def send() -> None:
        try:
            for piece in body:
                sock.sendall(piece)
        except OSError:  # the front answered and closed before reading it all
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        reply = _read_reply(sock)
    finally:
        sock.close()
        sender.join(30)
    return reply


def _read_reply(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, rest
        rest += chunk
    return status, rest[:length]


def _chunked(body: bytes, size: int = MIB) -> Iterable[bytes]:
    for at in range(0, len(body), size):
        piece = body[at : at + size]
        yield f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    yield b"0\r\n\r\n"


def _ids_body(size: int) -> bytes:
    """A JSON body of exactly `size` bytes: one prompt, padded with spaces."""
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}})
    return body.encode() + b" " * (size - len(body))


@pytest.mark.parametrize("chunked", [False, True])
def test_the_limit_is_strict_at_the_boundary(ids_front, chunked):
    """A body of exactly the limit is read and served; one byte more is 413."""
    for size, status in ((BODY_LIMIT, 200), (BODY_LIMIT + 1, 413)):
        body = _ids_body(size)
        if chunked:
            got, out = _post(ids_front.port, {"Transfer-Encoding": "chunked"}, _chunked(body))
        else:
            got, out = _post(ids_front.port, {"Content-Length": str(size)}, [body])
        assert got == status, (size, out[:200])
        if status == 413:
            assert json.loads(out)["error"]["code"] == 413


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1])


def test_refused_bodies_leave_the_front_at_its_idle_memory(text_front):
    """Over-limit bodies (announced, and streamed one byte over without a length) and texts
    too long for the context, each several times: the front's RSS stays near its idle RSS
    (a body parsed or tokenized would have grown it by many times the body's size, and a
    buffer the allocator kept by the limit's size)."""
    pid = text_front.proc.pid
    assert text_front.post("/generate", {"text": "w5 w6", "sampling_params": {}})[0] == 200
    idle = _rss_kib(pid)
    over = _ids_body(DEFAULT_LIMIT + 1)
    long_text = json.dumps({"text": "w1 " * (8 * MIB // 3)}).encode()
    assert len(long_text) <= DEFAULT_LIMIT
    for _ in range(3):
        status, _ = _post(text_front.port, {"Content-Length": str(len(over))}, [over])
        assert status == 413
        chunks = _chunked(over)
        assert _post(text_front.port, {"Transfer-Encoding": "chunked"}, chunks)[0] == 413
        status, out = _post(text_front.port, {"Content-Length": str(len(long_text))}, [long_text])
        assert status == 400 and b"characters" in out, out[:200]
    assert text_front.post("/generate", {"text": "w5 w6", "sampling_params": {}})[0] == 200
    grown = _rss_kib(pid) - idle
    assert grown < RSS_MARGIN_KIB, (idle, grown)


def test_a_text_longer_than_the_context_could_hold_is_400_unencoded(text_front):
    """The bound is the context times the longest token's characters (plus a separator):
    a text one character over it is refused before tokenization, one at it goes on to the
    tokenizer (and here to the server, which finds it too long in tokens)."""
    over = "w1 " * (MAX_TEXT_CHARS // 3) + "w" * (MAX_TEXT_CHARS % 3 + 1)
    assert len(over) == MAX_TEXT_CHARS + 1
    for body in ({"text": over}, {"text": ["w5", over]}):
        status, out = text_front.post("/generate", body)
        assert status == 400 and f"{MAX_TEXT_CHARS} characters" in out["error"]["message"], out
    status, out = text_front.post("/generate", {"text": over[:-1]})
    assert status == 400 and "characters" not in out["error"]["message"], out
    fits = " ".join(f"w{i}" for i in range(10, CONTEXT_LENGTH - 2))
    status, out = text_front.post("/generate", {"text": fits, "sampling_params": ONE})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == CONTEXT_LENGTH - 11, out


@pytest.fixture(scope="module")
def chat_front(serve, tokenizer_dir):
    """The word-level tokenizer with a chat template that writes each message and a space."""
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    front = Front.start(
        serve.port, "--tokenizer-path", str(tokenizer_dir), "--chat-template", template
    )
    yield front
    front.kill()


def test_openai_prompts_and_rendered_chats_are_bounded_too(chat_front):
    """A completion's text prompt is bounded as /generate's text; a chat's bound is on its
    rendered prompt: content one character short of the bound renders one over it."""
    over = "w1 " * (MAX_TEXT_CHARS // 3) + "w" * (MAX_TEXT_CHARS % 3 + 1)
    status, out = chat_front.post("/v1/completions", {"prompt": over, "max_tokens": 1})
    assert status == 400 and f"{MAX_TEXT_CHARS} characters" in out["error"]["message"], out
    for content, refused in ((over[:-1], True), (over[:-2], False)):
        chat = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        status, out = chat_front.post("/v1/chat/completions", chat)
        assert status == 400, out
        assert (f"{MAX_TEXT_CHARS} characters" in out["error"]["message"]) == refused, out
