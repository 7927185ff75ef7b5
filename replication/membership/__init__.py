"""Cluster membership, one import for both kinds: which nodes are live (kept in etcd
under leases; the value format and the rules are in ``replication/membership/base.py``).

The interface, the value format and the static list are ``membership_base``; the etcd
implementation (threads, retry policy, what its callers can rely on) is
``replication/membership/etcd.py``, which builds on the base (so neither imports this
module).
"""
from __future__ import annotations

from replication.membership.base import (
    DEFAULT_PREFIX,
    Callback,
    Membership,
    MembershipError,
    MembershipUnavailable,
    StaticMembership,
    View,
    ViewBroadcast,
    decode_member,
    encode_member,
)
from replication.membership.etcd import EtcdMembership

__all__ = ["DEFAULT_PREFIX", "Callback", "EtcdMembership", "Membership", "MembershipError",
           "MembershipUnavailable", "StaticMembership", "View", "ViewBroadcast",
           "decode_member", "encode_member"]
