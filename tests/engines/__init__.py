"""Engine tests. A package, so that its conftest is ``engines.conftest`` and never shadows
the main suite's ``conftest`` module (see conftest.py)."""
