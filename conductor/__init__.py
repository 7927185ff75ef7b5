"""The KV-cache-aware scheduler: routing, early rejection, cost model, traces, simulator."""
