"""How the transfer thread answers registrations, from whether the room is live and bound."""

from __future__ import annotations

import pytest
import zmq

from mpprefill.disagg import wire
from mpprefill.disagg.bootstrap_server import BootstrapEndpoint
from mpprefill.disagg.room_registry import RoomRegistry

A, B = b"registrant-a", b"registrant-b"
HERE, THERE = "127.0.0.1:5001", "127.0.0.1:5002"


@pytest.fixture
def registry():
    ctx = zmq.Context()
    endpoint = BootstrapEndpoint(ctx, "127.0.0.1", 0, expiry_s=10.0)
    yield RoomRegistry(endpoint)
    endpoint.close()
    ctx.term()


def test_a_registration_before_its_request_waits_and_the_request_claims_it(registry):
    assert registry.check(A, wire.RegisterRoom(7, HERE), False, None) == (None, None)
    assert set(registry.endpoint.waiting) == {7}
    assert registry.claim(7) == HERE and not registry.endpoint.waiting
    assert registry.claim(7) is None
    assert registry.withdraw(A, 7, live=True)  # the claimant's registrant owns the room
    assert not registry.withdraw(B, 7, live=True)


def test_a_refused_request_refuses_its_late_registration_with_its_status(registry):
    registry.refuse(7, "overloaded", 429)
    why, code = registry.check(A, wire.RegisterRoom(7, HERE), False, None)
    assert (why, code) == ("the prefill refused the request: overloaded", 429)
    assert registry.check(A, wire.RegisterRoom(7, HERE), False, None) == (None, None)  # once


def test_a_live_unbound_room_becomes_the_registrants(registry):
    assert registry.check(A, wire.RegisterRoom(7, HERE), True, None) == (None, None)
    assert not registry.endpoint.waiting  # bound by the caller, not held
    assert registry.withdraw(A, 7, live=True)
    registry.forget(7)
    assert not registry.withdraw(A, 7, live=True)


def test_a_bound_room_accepts_its_own_address_only(registry):
    assert registry.check(B, wire.RegisterRoom(7, HERE), True, HERE) == (None, None)
    why, _ = registry.check(B, wire.RegisterRoom(7, THERE), True, HERE)
    assert why == "room 7 is bound elsewhere"
    assert not registry.withdraw(B, 7, live=True)  # registering a bound room owns nothing


def test_a_peer_withdraws_its_own_waiting_registration_only(registry):
    registry.check(A, wire.RegisterRoom(7, HERE), False, None)
    assert not registry.withdraw(B, 7, live=False) and 7 in registry.endpoint.waiting
    assert registry.endpoint.refused == 1  # B was told the room is not its own
    assert not registry.withdraw(A, 7, live=False) and not registry.endpoint.waiting
