"""Bytes on the wire: the transfer channel's frames, the KV-event format, gRPC options."""
