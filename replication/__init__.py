"""Cluster replication: placement of blocks on nodes."""
