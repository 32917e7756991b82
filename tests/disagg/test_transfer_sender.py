"""The KV sender alone, its commands collected instead of run: the pairing of window pages
with the room's last pages, and its deadline for the decode side's answer."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.transfer_sender import SenderLimits, TransferSender
from tests.disagg.helpers import PAGE


def _sender(dst_pages: int, prefix_pages: int = 0, timeout: float = 30.0, ready: bool = True):
    """A sender bootstrapped with decode pages 10, 11, ...; (sender, its commands)."""
    cmds = []
    queue = SimpleNamespace(put=cmds.append)
    s = TransferSender("r", 1, queue, SenderLimits(64, 8, answer_timeout=timeout))
    if ready:
        s.ready(None, torch.arange(10, 10 + dst_pages), prefix_pages * PAGE, prefix_pages)
        s.init(dst_pages - prefix_pages)
    return s, cmds


def test_window_pages_pair_with_the_rooms_last_pages():
    s, cmds = _sender(6, 0)
    s.send(torch.arange(5), last=False)
    s.send(torch.tensor([5]), last=True, first_token=1, state_indices=torch.tensor([7, 3]))
    assert cmds[-1].swa_src.tolist() == [7, 3] and cmds[-1].swa_dst.tolist() == [14, 15]
    s, cmds = _sender(6, 3)  # the decode holds pages 0-2: window pages there are skipped
    s.send(torch.arange(3), last=True, first_token=1, state_indices=torch.arange(4))
    assert cmds[-1].swa_src.tolist() == [1, 2, 3] and cmds[-1].swa_dst.tolist() == [13, 14, 15]


def test_window_page_without_swa_kv_fails_the_request():
    s, _ = _sender(2, 0)
    with pytest.raises(ValueError):
        s.send(torch.arange(1), last=False, state_indices=torch.tensor([1]))  # not the last
    s.send(torch.arange(1), last=False)
    s.send(torch.tensor([1]), last=True, first_token=1, state_indices=torch.tensor([-1, 2]))
    assert s.poll() == KVPoll.Failed and "no sliding-window KV" in s.failure_reason()


def test_no_ack_within_the_deadline_fails_the_sender():
    s, cmds = _sender(2, timeout=0.2)
    s.send(torch.arange(1), last=False)
    time.sleep(0.3)  # the scheduler is slow: nobody waits for the decode side yet
    assert s.poll() == KVPoll.Transferring
    s.send(torch.tensor([1]), last=True, first_token=1)
    sent = time.monotonic()
    while s.poll() == KVPoll.Transferring:
        assert time.monotonic() - sent < 5
        time.sleep(0.01)
    assert time.monotonic() - sent >= 0.2
    assert s.poll() == KVPoll.Failed
    assert s.failure_reason() == "no answer from the decode side within 0.2s"
    assert cmds[-1].kind == "abort"  # the transfer thread tells the decode side to free it


def test_an_answer_in_time_stops_the_deadline():
    s, _ = _sender(1, timeout=0.2)
    s.send(torch.tensor([0]), last=True, first_token=1)
    s.succeed()
    time.sleep(0.3)
    assert s.poll() == KVPoll.Success


def test_no_bootstrap_reply_within_the_deadline_fails_the_sender():
    s, cmds = _sender(1, timeout=0.1, ready=False)
    assert s.poll() == KVPoll.Bootstrapping
    time.sleep(0.2)
    assert s.poll() == KVPoll.Failed and "bootstrap timed out" in s.failure_reason()
    assert cmds[-1].kind == "abort"
