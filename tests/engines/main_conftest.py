"""The main suite's conftest (``start_node``, ``free_port``, ...) for the engine tests.

Loaded by path under its own module name, so it cannot clash with this package's
``conftest`` (imported as ``engines.conftest``); every engine test module shares the one
copy in ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_NAME = "kvstore_tests_main_conftest"


def load() -> ModuleType:
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    path = Path(__file__).resolve().parent.parent / "conftest.py"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    return module


main = load()
