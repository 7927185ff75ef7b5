"""gRPC settings both ends share, and this host's identity for same-host shared memory.

Kept apart from ``kvstore.server`` so the client library does not import the server.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 512 << 20
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def host_id() -> str:
    """Identifies this machine's running kernel: equal ids mean a shared memory is possible."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
