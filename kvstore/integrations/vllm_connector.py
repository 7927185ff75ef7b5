"""The documented path of :mod:`kvstore.integrations.vllm.connector`, kept for what names it.

This module *is* that one: ``sys.modules`` maps both names to one module object, so its
classes, functions and state are shared (``import kvstore.integrations.vllm_connector`` gives
:mod:`kvstore.integrations.vllm.connector`).
"""

import sys

from kvstore.integrations.vllm import connector

sys.modules[__name__] = connector
