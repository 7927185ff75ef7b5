"""``conductor.front.sessions``: the session -> instance memory, bounded in size and time."""

from __future__ import annotations

import pytest

from conductor.front.sessions import MAX_SESSION_ID, SessionAffinity, session_of
from conductor.scheduling.types import InstanceId

A, B = InstanceId("http://a:1"), InstanceId("http://b:2")


def test_a_session_goes_where_its_last_request_went() -> None:
    s = SessionAffinity(max_sessions=10, ttl_s=60)
    assert s.instance("chat-1", 0.0) is None
    s.remember("chat-1", A, 0.0)
    s.remember("chat-2", B, 0.0)
    assert (s.instance("chat-1", 1.0), s.instance("chat-2", 1.0)) == (A, B)
    s.remember("chat-1", B, 2.0)  # its next turn ran elsewhere: follow it
    assert s.instance("chat-1", 3.0) == B


def test_entries_expire_after_the_ttl_since_their_last_use() -> None:
    s = SessionAffinity(max_sessions=10, ttl_s=60)
    s.remember("old", A, 0.0)
    s.remember("busy", B, 0.0)
    s.remember("busy", B, 50.0)
    assert s.instance("old", 60.0) == A  # the bound is inclusive
    assert s.instance("old", 60.5) is None
    assert s.instance("busy", 100.0) == B
    s.remember("new", A, 200.0)  # remembering sweeps what expired
    assert len(s) == 1


def test_the_least_recently_used_session_goes_first_when_full() -> None:
    s = SessionAffinity(max_sessions=2, ttl_s=600)
    s.remember("a", A, 0.0)
    s.remember("b", B, 1.0)
    s.remember("a", A, 2.0)  # a is the most recent now
    s.remember("c", B, 3.0)
    assert len(s) == 2
    assert (s.instance("a", 4.0), s.instance("b", 4.0), s.instance("c", 4.0)) == (A, None, B)


def test_header_values() -> None:
    assert session_of(None) is None
    assert session_of("  ") is None
    assert session_of(" conv-7 ") == "conv-7"
    assert session_of("x" * MAX_SESSION_ID) == "x" * MAX_SESSION_ID
    assert session_of("x" * (MAX_SESSION_ID + 1)) is None


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        SessionAffinity(max_sessions=0)
    with pytest.raises(ValueError, match="ttl_s"):
        SessionAffinity(ttl_s=0)
