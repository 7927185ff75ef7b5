"""kvstore as an LMCache remote storage plugin (``kvstore.integrations.lmcache_connector``)."""
