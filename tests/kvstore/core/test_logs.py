"""Structured logs and request ids, on real node processes (``--log-format json``)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
from pathlib import Path

import grpc
import pytest
from conftest import NodeProcess, start_node

from kvstore import Client
from kvstore.core.errors import ResourceExhausted
from kvstore.core.logs import (
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    accept_request_id,
    request_scope,
)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

FIXED = ("time", "level", "logger", "message")


def json_lines(node: NodeProcess) -> list[dict]:
    """Every line of the node's output (stdout and stderr), each parsed as one JSON object."""
    lines = node.output().splitlines()
    assert lines
    objects = []
    for line in lines:
        obj = json.loads(line)  # fails the test on any line that is not JSON
        assert isinstance(obj, dict) and list(obj)[:4] == list(FIXED), line
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", obj["time"]), line
        objects.append(obj)
    return objects


def raw_stub_error(addr: str, request_id: str | None) -> grpc.RpcError:
    """A Get with a 3-byte key, sent past the client's own checks."""
    metadata = (("x-request-id", request_id),) if request_id is not None else None
    with grpc.insecure_channel(addr) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.KVStoreStub(channel).Get(pb.GetRequest(key=b"abc"), timeout=10,
                                         metadata=metadata)
    return info.value


def trailing_request_id(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ())["x-request-id"]


def test_json_logs_and_request_ids_of_failed_calls(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--log-format", "json", dram="4MiB")
    try:
        with Client(node.addr, transport="grpc") as c:
            assert c.put(os.urandom(16), b"fits")
            with pytest.raises(ResourceExhausted) as too_big:
                c.put(os.urandom(16), b"x" * (5 << 20))  # larger than the node
        m = re.search(r"\(request id ([0-9a-f]{16})\)$", str(too_big.value))
        assert m, str(too_big.value)
        generated = m.group(1)
        # The client's own id is used as given, and returned.
        err = raw_stub_error(node.addr, "trace-42.abc")
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert trailing_request_id(err) == "trace-42.abc"
        # An id unfit for a log line (spaces, too long) is replaced by a fresh one.
        for unfit in ("has spaces", "x" * 200):
            replaced = trailing_request_id(raw_stub_error(node.addr, unfit))
            assert re.fullmatch(r"[0-9a-f]{16}", replaced)
        fresh = trailing_request_id(raw_stub_error(node.addr, None))
        assert len({generated, fresh, replaced}) == 3
    finally:
        assert node.stop() == 0, node.output()
    objects = json_lines(node)
    messages = [o["message"] for o in objects]
    assert any(msg.startswith("kvstore: serving on ") for msg in messages)
    assert messages[-1] == "kvstore: stopped"
    by_id = {o["request_id"]: o for o in objects if "request_id" in o}
    failed_put = by_id[generated]
    assert failed_put["level"] == "INFO" and failed_put["logger"] == "kvstore.requests"
    assert failed_put["code"] == "RESOURCE_EXHAUSTED" and failed_put["method"] == "BatchPut"
    assert "exceeds" in failed_put["message"]
    bad_key = by_id["trace-42.abc"]
    assert bad_key["code"] == "INVALID_ARGUMENT" and bad_key["method"] == "Get"
    assert fresh in by_id
    assert len(by_id) == 5  # only failed calls are logged: the good put is not


def test_text_logs_carry_the_request_id(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram="4MiB")
    try:
        err = raw_stub_error(node.addr, "grep-me-7")
    finally:
        assert node.stop() == 0, node.output()
    assert trailing_request_id(err) == "grep-me-7"
    line = next(x for x in node.output().splitlines() if "grep-me-7" in x)
    assert " INFO kvstore.requests: Get failed: INVALID_ARGUMENT: " in line
    assert line.endswith(" request_id=grep-me-7 method=Get code=INVALID_ARGUMENT")
    assert "kvstore: serving on" in node.output()  # plain text lines stay plain


def test_json_formatter_one_line_per_record_with_extras() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    log = logging.getLogger("test_logs.json")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        with request_scope("rid-1"):
            log.info("multi\nline %s", "message", extra={"blocks": 3, "level": "shadowed",
                                                           "path": Path("/x")})
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                log.exception("failed")
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    first, second, third = (json.loads(x) for x in lines)
    assert first["message"] == "multi\nline message" and first["level"] == "INFO"
    assert first["blocks"] == 3 and first["path"] == "/x" and first["request_id"] == "rid-1"
    assert second["request_id"] == "rid-1" and "RuntimeError: boom" in second["exception"]
    assert "request_id" not in third and third["level"] == "WARNING"


def test_text_formatter_appends_extras_before_a_traceback() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "bad %s", ("thing",), None)
    record.request_id = "r9"
    try:
        raise ValueError("v")
    except ValueError:
        record.exc_info = sys.exc_info()
    head, _, tail = TextFormatter().format(record).partition("\n")
    assert head.endswith("ERROR x: bad thing request_id=r9")
    assert "ValueError: v" in tail


def test_accept_request_id() -> None:
    assert accept_request_id("abc-123_x.y:z/w+=") == "abc-123_x.y:z/w+="
    assert accept_request_id(b"bytes-id") == "bytes-id"
    for bad in (None, "", "a b", "a\nb", "é", "x" * 129):
        assert re.fullmatch(r"[0-9a-f]{16}", accept_request_id(bad))
