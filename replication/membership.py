"""Cluster membership: which nodes are live, kept in etcd under leases.

Each live node stores one key, ``<prefix><node_id>``, whose value is the JSON
object ``{"node_id", "addr", "zone", "weight"}`` (a ``placement.Member``), attached
to an etcd lease the node keeps alive. A node that stops refreshing (crash, kill,
SIGSTOP, partition) loses its lease after ``ttl`` seconds and etcd deletes the key;
a node that leaves revokes the lease and the key goes at once. Every process
watches the prefix to keep its view of the live members.

One import for both kinds: the interface, the value format and the static list are
``replication/membership_base.py``; the etcd implementation (threads, retry policy,
what its callers can rely on) is ``replication/etcd_membership.py``, which builds on
the base (so neither imports this module).
"""
from __future__ import annotations

from replication.etcd_membership import EtcdMembership
from replication.membership_base import (
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

__all__ = ["DEFAULT_PREFIX", "Callback", "EtcdMembership", "Membership", "MembershipError",
           "MembershipUnavailable", "StaticMembership", "View", "ViewBroadcast",
           "decode_member", "encode_member"]
