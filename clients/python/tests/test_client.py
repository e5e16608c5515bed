"""Tests of the Python client against a live Tine control plane.

    TINE_ADDR=127.0.0.1:7070 TINE_TOKEN=... python3 tests/test_client.py
    TINE_TEST_TAG=py ...   # also spawn, eval, exec, files and kill on that snapshot

Without TINE_ADDR every test here is skipped (the server must be named explicitly, so
that a missing server fails loudly instead of being guessed at). Also runs under pytest.
"""

from __future__ import annotations

import os
import secrets
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _runner  # noqa: E402

import tine  # noqa: E402


def _addr() -> str:
    addr = os.environ.get("TINE_ADDR", "")
    if not addr:
        raise unittest.SkipTest("TINE_ADDR is not set: no live server to test against")
    return addr


def _client() -> tine.Client:
    return tine.Client(_addr(), call_timeout_s=30)


def _expect_code(code: str, fn: object, *args: object, **kwargs: object) -> tine.TineError:
    assert callable(fn)
    try:
        result = fn(*args, **kwargs)
    except tine.TineError as e:
        assert e.code == code, f"expected {code}, got {e.code}: {e.message}"
        assert isinstance(e.message, str)
        return e
    raise AssertionError(f"expected TineError {code}, got a result: {result!r}")


def test_list_snapshots() -> None:
    snaps = _client().snapshots()
    assert isinstance(snaps, list)
    for s in snaps:
        assert isinstance(s, tine.Snapshot) and s.tag
    print(f"     {len(snaps)} snapshot(s): {', '.join(s.tag for s in snaps)}")


def test_wrong_token_is_unauthenticated() -> None:
    bad = tine.Client(_addr(), token="wrong-" + secrets.token_hex(8), call_timeout_s=30)
    _expect_code("UNAUTHENTICATED", bad.snapshots)
    _expect_code("UNAUTHENTICATED", bad.spawn, "py", n=1)


def test_spawn_zero_is_invalid_argument() -> None:
    c = _client()
    tag = os.environ.get("TINE_TEST_TAG") or next((s.tag for s in c.snapshots()), "py")
    _expect_code("INVALID_ARGUMENT", c.spawn, tag, n=0)


def test_spawn_unknown_tag_is_not_found() -> None:
    c = _client()
    _expect_code("NOT_FOUND", c.spawn, "no-such-tag-" + secrets.token_hex(6), n=1)
    _expect_code("NOT_FOUND", c.snapshot, "no-such-tag-" + secrets.token_hex(6))


def _test_tag() -> str:
    tag = os.environ.get("TINE_TEST_TAG", "")
    if not tag:
        raise unittest.SkipTest("TINE_TEST_TAG is not set: no snapshot to spawn from")
    _addr()
    return tag


def test_spawn_eval_files_kill() -> None:
    tag = _test_tag()
    c = _client()
    try:
        sandboxes = c.spawn(tag, n=3)
    except tine.SpawnError as e:
        for sb in e.sandboxes:
            sb.kill()
        raise
    try:
        assert len(sandboxes) == 3
        assert len({sb.id for sb in sandboxes}) == 3
        for sb in sandboxes:
            assert sb.tag == tag and sb.state == "READY", sb
            assert sb.eval("1 + 1") == "2"
            assert sb.eval("tine_test_unset = None") is None
        print("     ready_us: " + ", ".join(f"{sb.id}={sb.ready_us}" for sb in sandboxes))

        # Children are forks, not one shared interpreter.
        sandboxes[0].eval("tine_test_x = 5")
        assert sandboxes[0].eval("tine_test_x * 2") == "10"
        assert sandboxes[1].eval("'tine_test_x' in globals()") == "False"

        try:
            sandboxes[0].eval("1 / 0")
        except tine.EvalError as e:
            assert "ZeroDivisionError" in e.traceback, e.traceback
        else:
            raise AssertionError("eval of 1 / 0 did not raise EvalError")

        listed = {sb.id for sb in c.sandboxes()}
        assert {sb.id for sb in sandboxes} <= listed, listed

        # A file bigger than one WriteFile chunk, with every byte value.
        data = bytes(range(256)) * (5 * 4096 + 3)
        for i, sb in enumerate(sandboxes):
            payload = data + str(i).encode()
            path = f"/tmp/tine-test-{i}.bin"
            assert sb.files.write(path, payload, mode=0o600) == len(payload)
            assert sb.files.read(path) == payload
        assert sandboxes[0].files.write("/tmp/tine-empty", b"") == 0
        assert sandboxes[0].files.read("/tmp/tine-empty") == b""
        try:
            sandboxes[0].files.read("/tmp/no-such-file-" + secrets.token_hex(4))
        except tine.TineError as e:
            print(f"     reading a missing file: {e.code}")
            assert e.code == "NOT_FOUND", e.code
        else:
            raise AssertionError("reading a missing file did not fail")
    finally:
        for sb in sandboxes:
            sb.kill()
    for sb in sandboxes:
        assert sb.state == "KILLED", sb
    _expect_code("NOT_FOUND", c.sandbox, "no-such-sandbox-" + secrets.token_hex(4))


def test_exec() -> None:
    tag = _test_tag()
    c = _client()
    with c.spawn(tag, n=1)[0] as sb:
        r = sb.exec(["/bin/sh", "-c", "echo out; echo err >&2; cat; exit 3"], stdin=b"in\n")
        assert r.exit_code == 3 and r.signal is None and not r.timed_out, r
        assert r.stdout == b"out\nin\n" and r.stderr == b"err\n", r
        r = sb.exec("echo $TINE_T; pwd", env={"TINE_T": "v"}, cwd="/tmp")
        assert r.ok and r.stdout == b"v\n/tmp\n", r
        r = sb.exec(["/bin/sh", "-c", "sleep 30"], timeout_s=1)
        assert r.timed_out, r
    assert sb.state == "KILLED", sb


if __name__ == "__main__":
    _runner.main("test_client", dict(globals()))
