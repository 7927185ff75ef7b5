"""``python -m workers``: see ``workers.cli``."""

import sys

from workers.cli import main

sys.exit(main())
