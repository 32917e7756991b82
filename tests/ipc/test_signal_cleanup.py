"""The cleanup signal handler against the owned-segment bookkeeping it interrupts."""

from __future__ import annotations

import pytest

import ipc
from tests.ipc import children

pytestmark = pytest.mark.timeout(60)


def test_signal_during_unlink_does_not_deadlock(ctx, prefix, procs):
    p = ctx.Process(target=children.signal_while_unlinking, args=(prefix,))
    p.start()
    procs.append(p)
    p.join(20)
    assert not p.is_alive(), "the signal handler deadlocked"
    assert p.exitcode == 0
    assert ipc.list_segments(prefix) == []  # the handler unlinked both segments
