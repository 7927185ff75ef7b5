"""The documented path of :mod:`kvstore.integrations.mooncake.store`, kept for what names it.

This module *is* that one: ``sys.modules`` maps both names to one module object, so its
classes, functions and state are shared (``import kvstore.integrations.mooncake_compat`` gives
:mod:`kvstore.integrations.mooncake.store`).
"""

import sys

from kvstore.integrations.mooncake import store

sys.modules[__name__] = store
