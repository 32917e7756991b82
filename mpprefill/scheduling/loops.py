"""The six event loops, side by side. Each mirrors DESIGN.md's order line by line.

A(N) = get_next_batch_to_run, F(N) = run_batch / submit, P(N) = process_batch_result,
S(N) = sample_if_needed. `until()` ends a loop; `idle()` waits for new work. Early send
of cached prefixes runs on the scheduler thread right before each submit, in every mode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mpprefill.scheduling.scheduler import Scheduler

Until = Callable[[], bool]


def _top(s: Scheduler) -> None:
    s.retire_host_store_writes()
    s.ingest_requests()
    s.pop_bootstrapped()


def event_loop_normal(s: Scheduler, until: Until) -> None:
    """A(N) F(N) P(N) inflight."""
    while not until():
        _top(s)
        batch = s.get_next_batch_to_run()
        if batch is not None:
            snap, result = s.run_batch(batch)
            result = s.sample_if_needed(snap, result)
            s.process_batch_result(batch, result)
        s.reqs.process_inflight_queue()
        s.idle(batch is not None)


def event_loop_overlap(s: Scheduler, until: Until) -> None:
    """A(N) F(N) P(N-1) inflight S(N). Also `thread` and `proc`: F = submit + collect."""
    result_queue: deque = deque()
    last_batch = None
    while not until():
        _top(s)
        batch = s.get_next_batch_to_run()
        if batch is not None:
            snap, result = s.run_batch(batch)
            result_queue.append([batch.copy(), snap, result])
        if last_batch is not None:
            prev_batch, _, prev_result = result_queue.popleft()
            s.process_batch_result(prev_batch, prev_result)
        s.reqs.process_inflight_queue()
        if batch is not None:
            entry = result_queue[-1]
            entry[2] = s.sample_if_needed(entry[1], entry[2])
        last_batch = batch
        s.idle(batch is not None)


def event_loop_ahead(s: Scheduler, until: Until) -> None:
    """A(N+1) snapshot+early-send(N+1) submit(N+1) collect(N) P(N) inflight.

    The worker holds N + 1 while it runs N, so it starts N + 1 the moment N ends. With
    deferred sampling S(N) needs the worker idle between N and N + 1, so the order is
    then A(N+1) collect(N) S(N) snapshot+early-send(N+1) submit(N+1) P(N) inflight.
    """
    inflight = None
    deferred = s.args.delay_sampling
    while not until():
        _top(s)
        batch = s.get_next_batch_to_run()
        prev_result = prev_batch = None
        if deferred and inflight is not None:
            prev_result = s.collect(inflight)  # waits if the worker is still busy
            prev_result = s.sample_if_needed(inflight, prev_result)  # worker idle here
            prev_batch = inflight.batch
        snap = None
        if batch is not None:
            snap = s.snapshot_for_forward(batch)
            s.send_cached_prefixes(snap)
            s.submit(snap)
        if not deferred and inflight is not None:
            prev_result = s.collect(inflight)  # waits if the worker is still busy
            prev_batch = inflight.batch
        if prev_result is not None:
            s.process_batch_result(prev_batch, prev_result)
        s.reqs.process_inflight_queue()
        inflight = snap
        s.idle(batch is not None or inflight is not None)


LOOPS: dict[str, Callable[[Scheduler, Until], None]] = {
    "normal": event_loop_normal,
    "overlap": event_loop_overlap,
    "thread": event_loop_overlap,
    "thread-ahead": event_loop_ahead,
    "proc": event_loop_overlap,
    "proc-ahead": event_loop_ahead,
}
