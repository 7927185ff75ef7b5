"""kvstore.remote.kv_event_subscriber: the state a router keeps from events (BlockLocations),
and the subscriber's CURVE keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.auth.curve import write_keypair
from kvstore.protocol.kv_event_wire import Cleared, Removed, Stored, encoder
from kvstore.remote.kv_event_subscriber import BlockLocations, KVEventSubscriber

K1, K2 = b"\x01" * 16, b"\x02" * 16


def test_apply_follows_stores_moves_removals_and_clears() -> None:
    enc = encoder(clock=lambda: 0.0)
    state = BlockLocations()
    state.apply(7, enc([Stored(key=K1, parent=None, medium="CPU"),
                        Stored(key=K2, parent=K1, medium="CPU")]))
    assert state.media == {K1: {"CPU"}, K2: {"CPU"}} and state.last_seq == 7
    # A move: stored on the new medium first, then removed from the old one.
    state.apply(8, enc([Stored(key=K1, parent=None, medium="STORAGE"),
                        Removed(key=K1, medium="CPU")]))
    assert state.media == {K1: {"STORAGE"}, K2: {"CPU"}}
    state.apply(9, enc([Removed(key=K2, medium="CPU"), Removed(key=K2, medium="CPU")]))
    assert state.media == {K1: {"STORAGE"}} and state.last_seq == 9
    state.apply(10, enc([Cleared(), Stored(key=K2, parent=None, medium="GPU")]))
    assert state.media == {K2: {"GPU"}} and state.last_seq == 10


def test_curve_needs_both_key_files(tmp_path: Path) -> None:
    public, secret = write_keypair(tmp_path, "router")
    with pytest.raises(ValueError, match="both secret_key"):
        KVEventSubscriber("tcp://127.0.0.1:1", secret_key=str(secret))
    with pytest.raises(ValueError, match="both secret_key"):
        KVEventSubscriber("tcp://127.0.0.1:1", server_key=str(public))
    with pytest.raises(ValueError, match="holds no secret key"):
        KVEventSubscriber("tcp://127.0.0.1:1", secret_key=str(public), server_key=str(public))
