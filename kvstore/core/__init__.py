"""The vocabulary every layer shares: keys, errors, sizes, checks, logs."""
