"""Mooncake Store 0.3.13's Python API on kvstore (``kvstore.integrations.mooncake_compat``)."""
