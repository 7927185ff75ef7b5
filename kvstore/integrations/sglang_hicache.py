"""The documented path of :mod:`kvstore.integrations.sglang.hicache`, kept for what names it.

This module *is* that one: ``sys.modules`` maps both names to one module object, so its
classes, functions and state are shared (``import kvstore.integrations.sglang_hicache`` gives
:mod:`kvstore.integrations.sglang.hicache`).
"""

import sys

from kvstore.integrations.sglang import hicache

sys.modules[__name__] = hicache
