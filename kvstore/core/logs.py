"""Logging of a node: text or one JSON object per line, and request ids.

Why JSON: log shippers (Loki, Elasticsearch, CloudWatch) index fields, not
prose; with ``--log-format json`` every line a node writes, on stderr and on
stdout, is one JSON object with at least ``time``, ``level``, ``logger`` and
``message``, plus the record's extra fields (``request_id`` among them).

Request ids: the gRPC interceptor (``kvstore.node.metrics.RequestInterceptor``) gives
every call an id, taken from the client's ``x-request-id`` metadata when it is a
sane token, else generated, and runs the handler inside ``request_scope(id)``.
Every record logged in that scope, by any logger, carries ``request_id``
(``RequestIdFilter``, installed by ``setup``), so an operator who sees
``(request id ...)`` in a client's error can grep the node's log for it.
Invariant: the scope is a ContextVar, reset when the handler returns, so a
gRPC worker thread never leaks one call's id into the next call's records.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

REQUEST_ID_HEADER = "x-request-id"
"""gRPC metadata key of a call's request id (lower case, as gRPC requires)."""

LOG_FORMATS = ("text", "json")

_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvstore_request_id",
                                                                         default=None)
_SANE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
"""A client's id is used as given only if it is this: short, printable, no spaces."""

_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}
"""Attributes every LogRecord has; anything else on a record is an extra field."""


def new_request_id() -> str:
    """A fresh id: 16 hex characters (64 random bits; collisions are not a concern for grep)."""
    return secrets.token_hex(8)


def accept_request_id(value: str | bytes | None) -> str:
    """The client's id if it is sane, else a fresh one (never trust a header into a log)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if value and _SANE_ID.match(value):
        return value
    return new_request_id()


def current_request_id() -> str | None:
    """The id of the request this thread is serving, or None outside one."""
    return _REQUEST_ID.get()


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Records logged inside carry ``request_id`` (once ``setup`` installed the filter)."""
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` to records made inside a ``request_scope`` (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _REQUEST_ID.get()
        if rid is not None and not hasattr(record, "request_id"):
            record.request_id = rid
        return True


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller added with ``extra=`` (and ``request_id``), in insertion order."""
    return {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}


def _iso_time(created: float) -> str:
    """UTC, millisecond precision, ``Z`` suffix: sortable as text and parsed by every shipper."""
    whole = int(created)
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
            + f".{int((created - whole) * 1000):03d}Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped).

    Fixed keys come first (``time``, ``level``, ``logger``, ``message``); a traceback
    goes in ``exception``; extra fields follow and never overwrite a fixed key.
    Values JSON cannot encode are written as their ``str``.
    """

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        for key, value in extra_fields(record).items():
            out.setdefault(key, value)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: MESSAGE key=value ...``: the extra fields appended for grep."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extra = extra_fields(record)
        if not extra:
            return text
        fields = " ".join(f"{k}={v}" for k, v in extra.items())
        head, sep, tail = text.partition("\n")  # keep a traceback below the fields
        return f"{head} {fields}{sep}{tail}"


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Sends every logger's records to ``stream`` (stderr) in ``fmt``, at ``level`` and above.

    Replaces the root logger's handlers (so it can be called again), routes
    ``warnings`` and uncaught exceptions of threads through logging, so that in
    JSON mode no stray multi-line traceback breaks the one-object-per-line rule.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_exception


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    # threading hands the hook the exception object itself; ExceptHookArgs types it as
    # optional, and logging takes no (type, None, traceback) triple.
    exc_info = ((args.exc_type, args.exc_value, args.exc_traceback)
                if args.exc_value is not None else None)
    logging.getLogger("kvstore").error("uncaught exception in thread %s", name,
                                       exc_info=exc_info)


def announce(text: str, *, fmt: str, logger: str = "kvstore.serve") -> None:
    """Prints a lifecycle line (``kvstore: serving on ...``) on stdout, flushed.

    Those lines are what scripts wait for, so their text is the same in both
    formats; in JSON mode it is the ``message`` of an INFO object.
    """
    if fmt == "json":
        record = logging.LogRecord(logger, logging.INFO, __file__, 0, text, None, None)
        print(JsonFormatter().format(record), flush=True)
    else:
        print(text, flush=True)
