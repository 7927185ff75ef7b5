"""Failures of the tier layer, independent of how the node reports them."""


class TierError(Exception):
    """Base of tier-layer errors."""


class BlockTooLarge(TierError):
    """The block is larger than the tier could ever hold."""


class OutOfSpace(TierError):
    """Nothing more can be evicted: what is left is pinned, being read or being written."""


class LeaseNotHeld(TierError, RuntimeError):
    """A read lease was released that is not held (released twice, or never taken): a bug
    in the caller. A RuntimeError too, as it was before it had a class of its own."""
