"""Wherever the forward runs (inline, on a forward thread, in a forward process; on the CPU
and on the emulated device) it runs under the guard (`MPPREFILL_TEST_FORWARD_GUARD`): no
read of a device tensor, and as many torch calls for 64 requests of 16 new tokens as for 4
of 256. One mode per worker kind: the modes of a kind run the same forward code, only
their loops differ (tests/scheduling/test_modes.py runs every loop)."""

from __future__ import annotations

import pathlib

import pytest

from mpprefill.engine import PrefillEngine
from mpprefill.modes import MODES
from mpprefill.worker.hooks import FORWARD_GUARD_ENV

pytestmark = pytest.mark.timeout(300)
ONE_PER_WORKER = ["normal", "thread-ahead", "proc-ahead"]
ENGINE_KW = dict(
    page_size=16,
    chunked_prefill_size=1024,
    max_prefill_tokens=1024,
    max_running_requests=64,
    check_invariants=True,
    # NOTE: one torch thread: two test workers share the cores, and a forward whose
    # threads wait for a busy core runs many times slower
    worker_threads=1,
)


def test_the_modes_run_here_cover_every_worker_kind():
    assert {MODES[m].worker for m in ONE_PER_WORKER} == {m.worker for m in MODES.values()}


def prompts(num: int, length: int, first: int) -> list[list[int]]:
    """Prompts that share no page, so each batch computes all of their tokens."""
    return [[first + i] + [7] * (length - 1) for i in range(num)]


def forward_calls(log_dir: pathlib.Path) -> dict[tuple[int, int], list[int]]:
    """(requests, tokens) -> torch calls of each forward the worker logged."""
    seen: dict[tuple[int, int], list[int]] = {}
    for f in log_dir.glob("forward-calls-*.txt"):
        for line in f.read_text().splitlines():
            reqs, tokens, calls = map(int, line.split())
            seen.setdefault((reqs, tokens), []).append(calls)
    return seen


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ONE_PER_WORKER)
def test_every_mode_forwards_without_device_reads_in_calls_flat_in_requests(
    mode, device, tmp_path, monkeypatch
):
    monkeypatch.setenv(FORWARD_GUARD_ENV, str(tmp_path))
    with PrefillEngine(forward_mode=mode, device=device, **ENGINE_KW) as eng:
        many = eng.prefill(prompts(64, 16, 100))
        few = eng.prefill(prompts(4, 256, 200))
        eng.check_invariants(flush=True)
    assert len(many) == 64 and len(few) == 4  # a DeviceRead would have failed them
    calls = forward_calls(tmp_path)
    assert set(calls) == {(64, 1024), (4, 1024)}, calls
    assert max(calls[64, 1024]) <= 1.15 * min(calls[4, 1024])
