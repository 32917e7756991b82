from __future__ import annotations

import gc
import json

import pytest

from mpprefill.trace import get_tracer, set_tracer
from mpprefill.trace.gc import GcWatch, freeze_heap
from mpprefill.trace.tracer import Tracer


@pytest.fixture
def watch():
    w = GcWatch(recent=2).install()
    yield w
    w.uninstall()


@pytest.fixture
def unfrozen():
    """Leaves the heap as other tests expect it: nothing in the permanent generation."""
    yield
    gc.unfreeze()


def _cycle() -> list:
    a: list = []
    a.append(a)
    return a


def test_forced_full_collection_is_a_gen2_pause(watch):
    _cycle()
    gc.collect(2)
    g2 = watch.gens[2]
    assert g2.count >= 1 and 0 < g2.max_s <= g2.total_s
    assert len(watch.recent_gen2_s) >= 1
    out = json.loads(json.dumps(watch.to_dict()))
    assert out["gen2"]["count"] == g2.count
    assert out["gen2"]["max_ms"] == pytest.approx(g2.max_s * 1e3)
    assert out["recent_gen2_ms"][-1] == pytest.approx(watch.recent_gen2_s[-1] * 1e3)


def test_young_collections_count_per_generation(watch):
    before = watch.gens[2].count
    gc.collect(0)
    gc.collect(1)
    assert watch.gens[0].count >= 1 and watch.gens[1].count >= 1
    assert watch.gens[2].count == before


def test_recent_gen2_list_is_bounded(watch):
    for _ in range(3):
        gc.collect(2)
    assert watch.gens[2].count >= 3
    assert len(watch.recent_gen2_s) == 2


def test_uninstall_stops_recording():
    w = GcWatch().install()
    w.install()  # twice: still one callback
    assert gc.callbacks.count(w._on_gc) == 1
    w.uninstall()
    assert not w.installed
    before = w.to_dict()
    gc.collect(2)
    assert w.to_dict() == before


def test_context_manager_installs_and_uninstalls():
    with GcWatch() as w:
        assert w.installed
        gc.collect(2)
    assert not w.installed and w.gens[2].count >= 1


def test_collections_are_traced_when_the_tracer_is_on(watch):
    prev = set_tracer(Tracer("scheduler", enabled=True))
    try:
        gc.collect(1)
        gc.collect(2)
        records = get_tracer().records
    finally:
        set_tracer(prev)
    names = [r[0] for r in records]
    assert "gc1" in names and "gc2" in names
    assert all(r[3] >= 0 for r in records)


def test_disabled_tracer_gets_no_spans(watch):
    prev = set_tracer(Tracer("scheduler", enabled=False))
    try:
        gc.collect(2)
        assert get_tracer().records == []
    finally:
        set_tracer(prev)


def test_freeze_heap_moves_objects_to_the_permanent_generation(unfrozen):
    kept = [_cycle() for _ in range(100)]
    frozen = freeze_heap()
    assert frozen == gc.get_freeze_count() >= len(kept)
    ids = {id(o) for o in gc.get_objects()}
    assert not any(id(k) in ids for k in kept)
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    ids = {id(o) for o in gc.get_objects()}
    assert all(id(k) in ids for k in kept)
