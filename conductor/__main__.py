"""``python -m conductor``: the ``conductor`` command."""

import sys

from conductor.cli import main

sys.exit(main())
