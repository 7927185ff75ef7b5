"""What the Mooncake class's method groups (``mooncake_ranges``, ``mooncake_upsert``,
``mooncake_tensors``, ``mooncake_cuda``) need from ``MooncakeDistributedStore``: declared
once here, defined there. Each group is a mixin of the store class and calls only these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.core.errors import KVStoreError
from kvstore.integrations.mooncake.types import ReplicateConfig, mooncake_key

Key = str | bytes


class StoreHost:
    """The store class's own helpers, as its method groups see them."""

    def _reader(self) -> Any:  # pragma: no cover
        """The client reads go through, or None before ``setup``."""
        raise NotImplementedError

    def _view(self, ptr: int, size: int) -> memoryview | None:  # pragma: no cover
        """Registered memory at ``ptr`` as a view, or None if not registered."""
        raise NotImplementedError

    def _writer(self, config: ReplicateConfig | None
                ) -> tuple[Any, dict[str, Any]]:  # pragma: no cover
        """The client a put goes through and its keyword arguments under ``config``."""
        raise NotImplementedError

    def _put(self, keys: Sequence[Key], values: Sequence[object | None],
             config: ReplicateConfig | None) -> list[int]:  # pragma: no cover
        """Mooncake's per-key codes for a put of ``values`` (None: that key refused)."""
        raise NotImplementedError

    def _values(self, keys: Sequence[Key]) -> list[bytes | None] | None:
        """Each key's value (None: a miss), or None for all: no client yet, or the read
        failed (Mooncake's reads answer a failure per key, never raise)."""
        client = self._reader()
        if client is None:
            return None
        try:
            return client.get_batch([mooncake_key(k) for k in keys])
        except (KVStoreError, TypeError):
            return None
