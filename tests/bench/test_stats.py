from __future__ import annotations

import io
import math

import pytest

from mpprefill.bench.progress import Progress
from mpprefill.bench.stats import percentile


def test_percentile_hand_values():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 25) == pytest.approx(1.75)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_not_a_tty_prints_one_final_line():
    out = io.StringIO()
    bar = Progress(10, desc="proc", file=out)
    for _ in range(10):
        bar.update()
    assert out.getvalue() == ""  # no spam into logs
    bar.close()
    bar.close()  # idempotent
    text = out.getvalue()
    assert text.count("\n") == 1 and "\r" not in text
    assert text.startswith("proc: [") and "10/10" in text and "/s" in text


def test_progress_tty_redraws_in_place():
    out = FakeTTY()
    with Progress(4, desc="x", file=out, min_interval_s=0.0) as bar:
        bar.update(2)
        assert out.getvalue().count("\r") == 1 and "2/4" in out.getvalue()
        assert "ETA" in bar.line()
        bar.update(2)
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1 and "4/4" in text
    assert "#" * 24 in text


def test_progress_throttles_redraws():
    out = FakeTTY()
    bar = Progress(1000, file=out, min_interval_s=60.0)
    for _ in range(999):
        bar.update()
    assert out.getvalue() == ""  # inside the interval, not yet done
    bar.update()
    assert "1000/1000" in out.getvalue()
    bar.close()


def test_progress_zero_total():
    out = io.StringIO()
    Progress(0, file=out).close()
    assert "0/0" in out.getvalue()
