"""The one check every Mooncake test makes: skip, with the engine's own reason, where no
engine starts (the package missing, or importable but without libibverbs and friends)."""

from __future__ import annotations

import functools

import pytest

from mpprefill.disagg.mooncake_backend import unavailable_reason


@functools.cache
def _reason() -> str | None:
    return unavailable_reason()


def skip_without_mooncake() -> None:
    reason = _reason()
    if reason is not None:
        pytest.skip(f"mooncake transfer engine unavailable: {reason}")
