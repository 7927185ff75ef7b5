"""The client side of one node: the gRPC client, the transfer channel's client, the KV-event
subscriber.
"""
