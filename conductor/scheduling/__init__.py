"""The Conductor's scheduler: its vocabulary, cost model, cluster view, policies and rejection."""
