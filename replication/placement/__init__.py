"""Where blocks go: weighted rendezvous placement and hot-block read counters."""
