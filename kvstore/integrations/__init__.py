"""Adapters that let serving engines use kvstore (optional; each imports only what it needs)."""
