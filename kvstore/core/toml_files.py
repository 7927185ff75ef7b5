"""Reading the TOML files an operator writes (the node's ``--config``, the ``--auth-file``).

One place maps what can go wrong with such a file, a file that cannot be read or text
that is not TOML, to a ValueError that names the file and what it is for: the CLI shows
it as a one-line error, never a traceback.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def load_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The document at ``path``; ``what`` names the file in errors (``"config"``)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid TOML: {exc}") from None
