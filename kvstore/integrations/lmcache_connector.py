"""The documented path of :mod:`kvstore.integrations.lmcache.connector`, kept for what names it.

This module *is* that one: ``sys.modules`` maps both names to one module object, so its
classes, functions and state are shared (``import kvstore.integrations.lmcache_connector`` gives
:mod:`kvstore.integrations.lmcache.connector`).
"""

import sys

from kvstore.integrations.lmcache import connector

sys.modules[__name__] = connector
