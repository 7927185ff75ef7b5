"""The discrete-event simulator over Mooncake traces, its metrics and the capacity search."""
