"""The documented path of :mod:`kvstore.remote.kv_event_subscriber`, kept for what names it.

This module *is* that one: ``sys.modules`` maps both names to one module object, so its
classes, functions and state are shared (``import kvstore.kv_event_subscriber`` gives
:mod:`kvstore.remote.kv_event_subscriber`).
"""

import sys

from kvstore.remote import kv_event_subscriber

sys.modules[__name__] = kv_event_subscriber
