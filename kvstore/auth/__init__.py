"""Who may call a node and what they see: tenants, TLS and tokens, quotas."""
