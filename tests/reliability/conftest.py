"""Fixtures of the reliability tests: serve processes that are always stopped and swept."""

from __future__ import annotations

import pytest

from tests.reliability.helpers import Serve


@pytest.fixture
def serve():
    """serve(*flags) -> a ready Serve; killed and its segments removed at the end."""
    started: list[Serve] = []

    def start(*flags: str) -> Serve:
        s = Serve.start(*flags)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()
