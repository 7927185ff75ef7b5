"""The store node: its semantics for every transport, its channel server, config, metrics, KV event
publisher.
"""
