"""Making and keeping copies: write quorums, forwarding, replication, repair and its rate limit."""
