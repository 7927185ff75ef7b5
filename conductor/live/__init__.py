"""The Conductor in front of kvstore's own prefill and decode workers."""
