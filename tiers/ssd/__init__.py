"""The SSD tier: immutable blocks on a file or block device, a durable index, O_DIRECT I/O."""
