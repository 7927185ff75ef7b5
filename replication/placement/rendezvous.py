"""Weighted rendezvous placement of block keys on live nodes.

Specification (version 1). Any client, in any language, reproduces this ranking.

* ``xxh3_64(b, seed)`` is XXH3-64 of the bytes ``b`` with the 64-bit ``seed``
  (``xxhash.xxh3_64_intdigest(b, seed=seed)``), as an unsigned 64-bit integer.
* Each node's seed is computed once, from its id::

      seed(node) = xxh3_64(b"kvstore-placement-v1\\x00" || utf8(node_id), seed=0)

* For a key (any bytes; block keys are 16 bytes) and a node::

      h     = xxh3_64(key, seed=seed(node))
      u     = (2 * (h >> 12) + 1) / 2**53          # exact in binary64, 0 < u < 1
      score = -weight(node) / ln(u)                 # binary64; higher ranks first

  ``u`` keeps the top 52 bits of ``h``, so the odd numerator fits a double's
  mantissa and ``u`` is exact, never 0 or 1. ``-ln(u)`` is then exponential
  with rate 1, ``score`` is ``weight / Exp(1)``, and a node is the top scorer with
  probability ``weight / sum(weights)``.
* The **ranking** of a key orders the nodes by score, highest first; equal scores
  (probability ~2**-52 per pair) go to the smaller node id (UTF-8 byte order).
  A correctly rounded or faithfully rounded ``ln`` is assumed; implementations
  whose ``ln`` differ by an ulp can disagree only on such near-ties. (This module
  itself uses ``math.log`` per key and numpy's ``log`` on its vectorised paths.)
* **Owners** of a key for ``R`` replicas, ``r = min(R, number of nodes)``:

  1. *zone picks*: walk the ranking and take each node whose zone has not been
     taken yet, until ``r`` nodes are taken or every zone is;
  2. *fill*: if fewer than ``r`` were taken, add the remaining nodes in ranking
     order until there are ``r``.

  Owners are listed zone picks first, then the fill, each in ranking order. The
  first owner, always the top-ranked node, is the key's **master**; the others
  are its replicas. With ``Z`` zones the first ``min(r, Z)`` owners are in
  distinct zones. ``zone == ""`` is a zone like any other, so a cluster that sets
  no zones places by plain ranking.

Moving membership: a key's score for a node depends only on that node and the
key, so adding or removing a node reorders nothing among the other nodes. When a
node leaves, only the keys it mastered change master (to their second-ranked
node); when a node joins, only the keys it now tops change master (to it). Each
is ``weight / total weight``, i.e. ``1/N`` of the keys for ``N`` equal nodes.

The module is pure: no I/O, no threads, and never Python's ``hash()``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

NodeId = NewType("NodeId", str)

SEED_DOMAIN = b"kvstore-placement-v1\x00"

# XXH3 on 9..16-byte inputs (what block keys are) needs only these two constants of
# its default secret: (secret[24:32] ^ secret[32:40]) and (secret[40:48] ^ secret[48:56]),
# both little-endian. The numpy path below reproduces xxhash.xxh3_64 for 16-byte keys.
_XXH3_FLIP1 = 0x6782737BEA4239B9
_XXH3_FLIP2 = 0xAF56BC3B0996523A
_XXH3_MX1 = 0x165667919E3779F9
_U64 = (1 << 64) - 1
_LO32 = np.uint64(0xFFFFFFFF)
_TWO_POW_M53 = 2.0**-53

# Below this many nodes the per-key scalar loop beats a numpy round trip.
_NUMPY_MIN_NODES = 48
# Keys from which ``candidates_many`` scores them all at once: numpy's fixed cost (some
# 20 us a call) against about 3 us a key one by one, with 3 nodes.
_NUMPY_MIN_KEYS = 8
# Keys per block of the vectorised paths (bounds the temporaries to ~chunk * nodes).
_CHUNK_CELLS = 1 << 18

U64Array = npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True, kw_only=True)
class Member:
    """A live node: ``weight`` is its capacity share (any positive finite number)."""

    node_id: NodeId
    addr: str
    zone: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float):
            raise ValueError(f"weight of {self.node_id!r} must be a number, got {w!r}")
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"weight of {self.node_id!r} must be finite and > 0, got {w!r}")
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ValueError(f"node_id must be a non-empty string, got {self.node_id!r}")


# ---- the formula, scalar -------------------------------------------------------------------


def node_seed(node_id: str) -> int:
    """The node's 64-bit hash seed (see the module spec)."""
    return xxhash.xxh3_64_intdigest(SEED_DOMAIN + node_id.encode("utf-8"))


def key_hash(key: bytes, seed: int) -> int:
    """``xxh3_64(key, seed)`` for one (node seed, key) pair."""
    return xxhash.xxh3_64_intdigest(key, seed=seed)


def unit_from_hash(h: int) -> float:
    """``(2 * (h >> 12) + 1) / 2**53``: exact, strictly inside (0, 1)."""
    return (2 * (h >> 12) + 1) * _TWO_POW_M53


def score_from_hash(h: int, weight: float) -> float:
    return -weight / math.log(unit_from_hash(h))


# ---- the formula, vectorised -----------------------------------------------------------------


def split_keys16(keys: Sequence[bytes] | bytes) -> tuple[U64Array, U64Array]:
    """16-byte keys as two little-endian uint64 columns (first and last 8 bytes)."""
    buf = keys if isinstance(keys, bytes | bytearray) else b"".join(keys)
    if len(buf) % 16:
        raise ValueError("keys must be 16 bytes each")
    words = np.frombuffer(buf, dtype="<u8").reshape(-1, 2).astype(np.uint64)
    return words[:, 0].copy(), words[:, 1].copy()


def xxh3_64_key16(k0: U64Array, k1: U64Array, seeds: U64Array) -> U64Array:
    """``xxh3_64(key, seed)`` of 16-byte keys, broadcast over ``k0``/``k1`` and ``seeds``.

    ``k0``/``k1`` are the key's two little-endian 64-bit words. A (K, 1) key
    column against an (N,) row of seeds gives the (K, N) hash matrix. Equal to
    ``xxhash.xxh3_64_intdigest`` bit for bit (the 9..16-byte path of XXH3).
    """
    seeds = np.asarray(seeds, dtype=np.uint64)
    flip1 = np.uint64(_XXH3_FLIP1) + seeds  # uint64 arrays wrap silently, as in C
    flip2 = np.uint64(_XXH3_FLIP2) - seeds
    lo = np.bitwise_xor(k0, flip1)
    hi = np.bitwise_xor(k1, flip2)
    acc = lo.byteswap()
    acc += hi
    acc += np.uint64(16)
    acc += _mul128_fold64(lo, hi)
    return _avalanche(acc)


def _mul128_fold64(a: U64Array, b: U64Array) -> U64Array:
    """High 64 bits XOR low 64 bits of the 128-bit product ``a * b``."""
    a0 = a & _LO32
    a1 = a >> np.uint64(32)
    b0 = b & _LO32
    b1 = b >> np.uint64(32)
    t = a1 * b0
    t += (a0 * b0) >> np.uint64(32)
    w = t & _LO32
    w += a0 * b1
    hi = a1 * b1
    hi += t >> np.uint64(32)
    hi += w >> np.uint64(32)
    hi ^= a * b
    return hi


def _avalanche(h: U64Array) -> U64Array:
    h ^= h >> np.uint64(37)
    h *= np.uint64(_XXH3_MX1)
    h ^= h >> np.uint64(32)
    return h


def scores_from_hashes(h: U64Array, weights: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``-weight / ln(u)`` elementwise; ``weights`` broadcasts against ``h``."""
    u = (h >> np.uint64(12)).astype(np.float64)
    u *= 2.0
    u += 1.0
    u *= _TWO_POW_M53
    np.log(u, out=u)
    return np.divide(-np.asarray(weights, dtype=np.float64), u)


# ---- placement -------------------------------------------------------------------------------


class Placement:
    """An immutable view of the live members: ranks, masters and owners of keys.

    Build a new one when membership changes; it is cheap (one hash per node).
    """

    __slots__ = ("_ids", "_index", "_members", "_n_zones", "_seeds", "_seeds_np",
                 "_weights", "_weights_np", "_zone_cols", "_zone_of", "_zone_of_np")

    def __init__(self, members: Iterable[Member]) -> None:
        # Code point order, which is UTF-8 byte order.
        ms = sorted(members, key=lambda m: m.node_id)
        for a, b in itertools.pairwise(ms):
            if a.node_id == b.node_id:
                raise ValueError(f"duplicate node id {a.node_id!r}")
        self._members: tuple[Member, ...] = tuple(ms)
        self._ids: tuple[NodeId, ...] = tuple(m.node_id for m in ms)
        self._index = {nid: i for i, nid in enumerate(self._ids)}
        self._seeds = [node_seed(m.node_id) for m in ms]
        self._weights = [float(m.weight) for m in ms]
        zones: dict[str, int] = {}
        self._zone_of = [zones.setdefault(m.zone, len(zones)) for m in ms]
        self._n_zones = len(zones)
        self._seeds_np: U64Array = np.array(self._seeds, dtype=np.uint64)
        self._weights_np = np.array(self._weights, dtype=np.float64)
        self._zone_of_np = np.array(self._zone_of, dtype=np.intp)
        self._zone_cols = [np.flatnonzero(self._zone_of_np == z) for z in range(self._n_zones)]

    # -- membership

    @property
    def members(self) -> tuple[Member, ...]:
        """Members in node id order (the column order of the vectorised results)."""
        return self._members

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        return self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._index

    def member(self, node_id: str) -> Member:
        return self._members[self._index[NodeId(node_id)]]

    def share(self, node_id: str) -> float:
        """The expected fraction of keys ``node_id`` masters: its weight over the total."""
        return self._weights[self._index[NodeId(node_id)]] / sum(self._weights)

    # -- one key

    def scores(self, key: bytes) -> list[float]:
        """Every node's score for ``key``, in ``node_ids`` order."""
        if len(self._ids) >= _NUMPY_MIN_NODES and len(key) == 16:
            k0, k1 = split_keys16(bytes(key))
            h = xxh3_64_key16(k0, k1, self._seeds_np)
            return [float(s) for s in scores_from_hashes(h, self._weights_np)]
        return [score_from_hash(key_hash(key, s), w)
                for s, w in zip(self._seeds, self._weights, strict=True)]

    def _ranking(self, key: bytes) -> list[int]:
        s = self.scores(key)
        return sorted(range(len(s)), key=lambda i: -s[i])  # stable: ties by node id

    def rank(self, key: bytes) -> list[NodeId]:
        """All nodes, best first: master, then the next candidates for failover or fan-out.

        Plain rendezvous order, without the zone rule that ``owners`` applies.
        """
        return [self._ids[i] for i in self._ranking(key)]

    def master(self, key: bytes) -> NodeId:
        """The top-ranked node. LookupError if there are no nodes."""
        if not self._ids:
            raise LookupError("no live nodes")
        s = self.scores(key)
        best = max(range(len(s)), key=lambda i: s[i])  # first maximum: smallest id on ties
        return self._ids[best]

    def owners(self, key: bytes, replicas: int) -> list[NodeId]:
        """Master first, then replicas: ``min(replicas, len(self))`` nodes (zone rule above)."""
        r = self._check_replicas(replicas)
        if r == 0:
            return []
        if r == 1:
            return [self.master(key)]
        return [self._ids[i] for i in self._select(self._ranking(key), r)]

    def candidates(self, key: bytes, replicas: int) -> tuple[list[NodeId], list[NodeId]]:
        """``(owners(key, replicas), the other nodes in ranking order)`` from one ranking."""
        return self._candidates(self._ranking(key), self._check_replicas(replicas))

    def candidates_many(self, keys: Sequence[bytes], replicas: int
                        ) -> list[tuple[list[NodeId], list[NodeId]]]:
        """``[candidates(k, replicas) for k in keys]``; from ``_NUMPY_MIN_KEYS`` keys on,
        the scores of every key and node at once (a batch's fresh keys rank in a fraction of
        the time one by one takes)."""
        r = self._check_replicas(replicas)
        if len(keys) < _NUMPY_MIN_KEYS or not self._ids:
            return [self._candidates(self._ranking(k), r) for k in keys]
        step = max(1, _CHUNK_CELLS // len(self._ids))
        out: list[tuple[list[NodeId], list[NodeId]]] = []
        for a in range(0, len(keys), step):
            s = self.score_matrix(keys[a:a + step])
            # stable: ties by node id, as ``_ranking``
            for ranking in np.argsort(-s, axis=1, kind="stable").tolist():
                out.append(self._candidates(ranking, r))
        return out

    def _candidates(self, ranking: list[int], r: int) -> tuple[list[NodeId], list[NodeId]]:
        picks = self._select(ranking, r) if r else []
        taken = set(picks)
        return ([self._ids[i] for i in picks],
                [self._ids[i] for i in ranking if i not in taken])

    def _select(self, ranking: list[int], r: int) -> list[int]:
        picks: list[int] = []
        used: set[int] = set()
        for i in ranking:
            z = self._zone_of[i]
            if z not in used:
                picks.append(i)
                used.add(z)
                if len(picks) == r or len(used) == self._n_zones:
                    break
        if len(picks) < r:
            taken = set(picks)
            picks.extend([i for i in ranking if i not in taken][: r - len(picks)])
        return picks

    def _check_replicas(self, replicas: int) -> int:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        return min(replicas, len(self._ids))

    # -- many keys

    def score_matrix(self, keys: Sequence[bytes]) -> npt.NDArray[np.float64]:
        """Scores as a (len(keys), len(self)) matrix, columns in ``node_ids`` order."""
        n = len(self._ids)
        out = np.empty((len(keys), n), dtype=np.float64)
        if n == 0:
            return out
        rows16 = [i for i, k in enumerate(keys) if len(k) == 16]
        if rows16:
            idx = np.array(rows16, dtype=np.intp)
            k0, k1 = split_keys16([keys[i] for i in rows16])
            step = max(1, _CHUNK_CELLS // n)
            for a in range(0, len(rows16), step):
                h = xxh3_64_key16(k0[a:a + step, None], k1[a:a + step, None], self._seeds_np)
                out[idx[a:a + step]] = scores_from_hashes(h, self._weights_np)
        if len(rows16) != len(keys):
            for i, k in enumerate(keys):
                if len(k) != 16:
                    out[i] = [score_from_hash(key_hash(k, s), w)
                              for s, w in zip(self._seeds, self._weights, strict=True)]
        return out

    def owner_indices_many(self, keys: Sequence[bytes], replicas: int) -> npt.NDArray[np.intp]:
        """``owners`` of every key as a (len(keys), r) matrix of column indices."""
        r = self._check_replicas(replicas)
        k = len(keys)
        if r == 0 or k == 0:
            return np.empty((k, r), dtype=np.intp)
        step = max(1, _CHUNK_CELLS // len(self._ids))
        return np.concatenate([self._owner_block(self.score_matrix(keys[a:a + step]), r)
                               for a in range(0, k, step)])

    def owners_many(self, keys: Sequence[bytes], replicas: int) -> list[list[NodeId]]:
        """``[owners(k, replicas) for k in keys]``, vectorised over keys and nodes."""
        ids = self._ids
        return [[ids[i] for i in row] for row in self.owner_indices_many(keys, replicas).tolist()]

    def masters_many(self, keys: Sequence[bytes]) -> list[NodeId]:
        ids = self._ids
        return [ids[row[0]] for row in self.owner_indices_many(keys, 1).tolist()]

    def _owner_block(self, s: npt.NDArray[np.float64], r: int) -> npt.NDArray[np.intp]:
        k, n = s.shape
        if r == 1:
            first: npt.NDArray[np.intp] = np.argmax(s, axis=1)[:, None]
            return first  # first maximum: smallest id on ties
        top = _top_ranked(s, r)  # (k, r) best first
        nz = self._n_zones
        if nz == 1:
            return top
        rows = np.arange(k)[:, None]
        # The top node of every zone, then zones ordered by that node's (score, id).
        zone_top = np.stack([cols[np.argmax(s[:, cols], axis=1)] for cols in self._zone_cols],
                            axis=1)
        zone_top_score = np.take_along_axis(s, zone_top, axis=1)
        order = np.lexsort((zone_top, -zone_top_score), axis=1)
        picks = np.take_along_axis(zone_top, order, axis=1)
        if r <= nz:
            return picks[:, :r]
        # All zones are picked; fill from the ranking, skipping the zone tops. At most
        # nz of the top r are zone tops, so the top r hold the r - nz nodes needed.
        is_pick = np.zeros((k, n), dtype=bool)
        is_pick[rows, zone_top] = True
        skip = is_pick[rows, top]
        fill_pos = np.argsort(skip, axis=1, kind="stable")[:, : r - nz]
        fill = np.take_along_axis(top, fill_pos, axis=1)
        return np.concatenate([picks, fill], axis=1)


def _top_ranked(s: npt.NDArray[np.float64], r: int) -> npt.NDArray[np.intp]:
    """Column indices of the ``r`` best scores per row, best first, ties by column."""
    n = s.shape[1]
    if n <= 4 * r or n <= 64:
        return np.argsort(-s, axis=1, kind="stable")[:, :r]
    part = np.argpartition(-s, r - 1, axis=1)[:, :r]
    part.sort(axis=1)  # column order first, so the stable sort breaks ties by id
    order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)
