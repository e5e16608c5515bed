"""Offline tests of the Python client: configuration, the unavailable-server path, and
every call against an in-process fake control plane (tests/fake_server.py).

    python3 tests/test_offline.py        # or: pytest tests/
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# grpc's C core logs a line at INFO whenever a test server goes away under a client.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _runner  # noqa: E402
from fake_server import TOKEN, FakeServer  # noqa: E402

import tine  # noqa: E402

_ENV_KEYS = (
    "TINE_ADDR",
    "TINE_TOKEN",
    "TINE_TOKEN_FILE",
    "TINE_DATA_DIR",
    "XDG_DATA_HOME",
    "TINE_TLS_CA",
    "HOME",
    "TINE_ALLOW_PLAINTEXT_REMOTE",
)


@contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    try:
        for k in _ENV_KEYS:
            os.environ.pop(k, None)
        os.environ.update(values)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _served() -> Iterator[tuple[FakeServer, tine.Client]]:
    with FakeServer() as srv, tine.Client(srv.addr, token=TOKEN, call_timeout_s=10) as client:
        yield srv, client


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _raises(code: str, fn: object, *args: object, **kwargs: object) -> tine.TineError:
    assert callable(fn)
    try:
        fn(*args, **kwargs)
    except tine.TineError as e:
        assert e.code == code, f"expected {code}, got {e!r}"
        return e
    raise AssertionError(f"expected TineError {code}")


# -- configuration ----------------------------------------------------------------------


def test_resolve_addr() -> None:
    cases = {
        "127.0.0.1:7070": ("127.0.0.1:7070", None),
        "http://127.0.0.1:7070": ("127.0.0.1:7070", False),
        "http://localhost:8080/": ("localhost:8080", False),
        "https://tine.example.com:443": ("tine.example.com:443", True),
        "tine.example.com": ("tine.example.com:7070", None),
        "[::1]:9000": ("[::1]:9000", None),
        "::1": ("[::1]:7070", None),
        "unix:/run/tine.sock": ("unix:/run/tine.sock", False),
    }
    for raw, want in cases.items():
        assert tine.resolve_addr(raw) == want, (raw, tine.resolve_addr(raw))
    for bad in ("ftp://x:1", "http://x:1/path", "x:0", "x:http", "[::1", ":7070", "http://"):
        try:
            tine.resolve_addr(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")
    with _env():
        assert tine.resolve_addr(None) == (tine.DEFAULT_ADDR, None)
    with _env(TINE_ADDR="http://10.1.2.3:7000"):
        assert tine.resolve_addr(None) == ("10.1.2.3:7000", False)


def test_tls_choice() -> None:
    with _env():
        assert tine.Client("127.0.0.1:7070", token="t").tls is False
        assert tine.Client("localhost:7070", token="t").tls is False
        assert tine.Client("[::1]:7070", token="t").tls is False
        assert tine.Client("tine.example.com:7070", token="t").tls is True
        # The token never goes in clear off loopback unless the caller says the network is trusted.
        e = _raises("INVALID_ARGUMENT", tine.Client, "http://tine.example.com:7070", token="t")
        assert "TINE_ALLOW_PLAINTEXT_REMOTE=1" in str(e), e
        plain = tine.Client("http://tine.example.com:7070", token="t", allow_plaintext_remote=True)
        assert plain.tls is False
    with _env(TINE_ALLOW_PLAINTEXT_REMOTE="1"):
        assert tine.Client("http://10.1.2.3:7070", token="t").tls is False
    with _env():
        assert tine.Client("https://127.0.0.1:7070", token="t").tls is True
        # An explicit CA means TLS, even on loopback.
        assert tine.Client("127.0.0.1:7070", token="t", tls_ca=b"-----BEGIN CERTIFICATE-----\n").tls is True
        _raises("UNAVAILABLE", tine.Client, "127.0.0.1:7070", token="t", tls_ca="/nonexistent/ca.pem")


def test_resolve_token() -> None:
    with tempfile.TemporaryDirectory() as d:
        tf = Path(d) / "tok"
        tf.write_text("from-file\n")
        (Path(d) / "data").mkdir()
        (Path(d) / "data" / "admin.token").write_text(" admin-file \n")
        with _env(TINE_TOKEN="from-env", TINE_TOKEN_FILE=str(tf)):
            assert tine.resolve_token() == "from-env"
            assert tine.resolve_token("explicit") == "explicit"
        with _env(TINE_TOKEN_FILE=str(tf), TINE_DATA_DIR=str(Path(d) / "data")):
            assert tine.resolve_token() == "from-file"
        with _env(TINE_DATA_DIR=str(Path(d) / "data")):
            assert tine.resolve_token() == "admin-file"
        with _env(XDG_DATA_HOME=d):
            (Path(d) / "tine").mkdir()
            (Path(d) / "tine" / "admin.token").write_text("xdg")
            assert tine.resolve_token() == "xdg"
        with _env(HOME=d):
            e = _raises("UNAUTHENTICATED", tine.resolve_token)
            assert ".local/share/tine/admin.token" in e.message, e.message
        with _env(TINE_TOKEN_FILE=str(Path(d) / "missing")):
            _raises("UNAUTHENTICATED", tine.resolve_token)
        with _env(TINE_DATA_DIR=d):
            _raises("UNAUTHENTICATED", tine.Client, "127.0.0.1:1")


def test_unavailable_server() -> None:
    client = tine.Client(f"127.0.0.1:{_closed_port()}", token="t", call_timeout_s=10)
    e = _raises("UNAVAILABLE", client.snapshots)
    assert e.status is not None and e.status.name == "UNAVAILABLE"
    assert str(e).startswith("UNAVAILABLE: ")
    _raises("UNAVAILABLE", client.spawn, "py", n=3)
    _raises("UNAVAILABLE", lambda: list(client.iter_spawn("py", n=3)))
    _raises("UNAVAILABLE", client.executors)


# -- against the fake control plane -----------------------------------------------------


def test_snapshots() -> None:
    with _served() as (_, c):
        assert sorted(s.tag for s in c.snapshots()) == ["base", "py", "py-child"]
        s = c.snapshot("py")
        assert s.tag == "py" and s.parent_tag == "base" and s.image == "python-numpy"
        assert [a.tag for a in s.ancestors] == ["base"]
        assert [d.tag for d in s.descendants] == ["py-child"]
        assert c.snapshots()[0].ancestors == ()
        _raises("NOT_FOUND", c.snapshot, "nope")
        made = c.create_snapshot("warm", "python-numpy", warmup="import json", vcpus=2)
        assert made.tag == "warm" and made.vcpus == 2 and made.mem_mib == 512
        _raises("FAILED_PRECONDITION", c.delete_snapshot, "py")
        assert c.delete_snapshot("py", cascade=True) == ["py", "py-child"]


def test_auth() -> None:
    with FakeServer() as srv:
        bad = tine.Client(srv.addr, token="wrong")
        e = _raises("UNAUTHENTICATED", bad.snapshots)
        assert "token" in e.message
        _raises("UNAUTHENTICATED", bad.spawn, "py", n=2)
        with _env(TINE_ADDR=f"http://{srv.addr}", TINE_TOKEN=TOKEN):
            assert len(tine.Client().snapshots()) == 3


def test_spawn() -> None:
    with _served() as (srv, c):
        _raises("INVALID_ARGUMENT", c.spawn, "py", n=0)
        _raises("NOT_FOUND", c.spawn, "nope", n=1)
        sbs = c.spawn("py", n=3, policy="pack", timeout_s=5)
        assert [sb.ready_us for sb in sbs] == [1000, 1001, 1002]  # request order
        assert all(sb.state == "READY" and sb.executor == "ex-1" and sb.tag == "py" for sb in sbs)
        assert {sb.id for sb in c.sandboxes()} == {sb.id for sb in sbs}
        events = list(c.iter_spawn("py", n=2))
        assert [ev.index for ev in events] == [1, 0] and all(ev.ok for ev in events)
        try:
            c.spawn("py", n=1, policy="random")
        except ValueError:
            pass
        else:
            raise AssertionError("bad policy accepted")


def test_resources_and_usage() -> None:
    with _served() as (srv, c):
        sb = c.spawn("py", n=1, memory_limit_mib=128, cpu_millis=250)[0]
        assert (sb.memory_limit_mib, sb.cpu_millis) == (128, 250)
        assert sb.usage is None, "not read yet"
        u = sb.refresh().usage
        assert u is not None and u.memory_current_bytes == 3 << 20 and u.cpu_usage_us == 250
        # Its lifetime: as spawned, then moved.
        sb2 = c.spawn("py", n=1, lifetime_s=60)[0]
        assert sb2.expires_unix_ms == 1_700_000_060_000
        assert sb2.set_timeout(600).expires_unix_ms == 1_700_000_600_000
        _raises("INVALID_ARGUMENT", sb2.set_timeout, 0)
        # The control plane's verdict on an ended one: its reason, no usage.
        srv.state.sandboxes[sb.id].state = tine.v1.tine_pb2.SANDBOX_STATE_FAILED
        srv.state.sandboxes[sb.id].error = "out of memory: its VMM was killed at its limit of 128 MiB"
        sb.refresh()
        assert sb.state == "FAILED" and sb.error.startswith("out of memory") and sb.usage is None


def test_network_policy_and_exposed_ports() -> None:
    with _served() as (srv, c):
        c.spawn("py", n=1)
        assert srv.state.last_network is None, "nothing asked: the executor's default"
        c.spawn("py", n=1, internet=False, allow=["198.51.100.0/24:443"], deny=["198.51.100.9"])
        n = srv.state.last_network
        assert n is not None and n.internet == tine.v1.tine_pb2.INTERNET_DENY
        assert list(n.allow) == ["198.51.100.0/24:443"] and list(n.deny) == ["198.51.100.9"]
        c.spawn("py", n=1, internet=True)
        n = srv.state.last_network
        assert n is not None and n.internet == tine.v1.tine_pb2.INTERNET_ALLOW
        try:
            c.spawn("py", n=1, allow="10.0.0.0/8")
        except TypeError:
            pass
        else:
            raise AssertionError("a bare string taken as a list of entries")
        sb = c.spawn("py", n=1)[0]
        assert sb.expose_port(8000) == "127.0.0.1:48000"
        _raises("INVALID_ARGUMENT", sb.expose_port, 70000)


def test_spawn_partial_failure() -> None:
    with _served() as (_, c):
        try:
            c.spawn("flaky", n=3)
        except tine.SpawnError as e:
            assert isinstance(e, tine.TineError)
            assert e.code == "RESOURCE_EXHAUSTED", e
            assert [f.index for f in e.failures] == [1]
            assert e.failures[0].executor == "ex-1" and e.failures[0].message == "no memory"
            assert [sb.ready_us for sb in e.sandboxes] == [1000, 1002]
            assert "1 of 3 children" in e.message, e.message
            for sb in e.sandboxes:
                sb.kill()
        else:
            raise AssertionError("no SpawnError")
        evs = list(c.iter_spawn("flaky", n=3))
        assert [ev.ok for ev in sorted(evs, key=lambda ev: ev.index)] == [True, False, True]
        # The stream breaks off after some children were ready: those are handed back.
        try:
            c.spawn("broken-stream", n=3)
        except tine.SpawnError as e:
            assert e.code == "INTERNAL" and len(e.sandboxes) == 2 and not e.failures, e
        else:
            raise AssertionError("no SpawnError")


def test_sandbox_context_manager() -> None:
    with _served() as (srv, c):
        with c.spawn("py", n=1)[0] as sb:
            assert sb.eval("1 + 1") == "2"
        assert sb.state == "KILLED"
        assert srv.state.sandboxes[sb.id].state == 4  # KILLED
        # An exception in the block is not hidden by the kill.
        try:
            with c.spawn("py", n=1)[0] as sb2:
                raise KeyError("boom")
        except KeyError:
            pass
        assert srv.state.sandboxes[sb2.id].state == 4
        # Killed inside the block: no second kill, no error.
        with c.spawn("py", n=1)[0] as sb3:
            sb3.kill()
        _raises("NOT_FOUND", c.sandbox, "nope")
        assert c.sandbox(sb3.id).state == "KILLED"
        assert len(c.sandboxes()) == 0 and len(c.sandboxes(all=True)) == 3


def test_eval() -> None:
    with _served() as (_, c):
        a, b = c.spawn("py", n=2)
        assert a.eval("x = 21") is None
        assert a.eval("x * 2") == "42"
        assert a.eval("y = 'hi'\ny") == "'hi'"
        try:
            b.eval("x * 2")
        except tine.EvalError as e:
            assert "NameError" in e.traceback, e.traceback
        else:
            raise AssertionError("no EvalError")
        r = b.eval_result("1 / 0")
        assert r.value is None and r.error is not None and "ZeroDivisionError" in r.error
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert a.eval("restart") is None
            assert any("restarted" in str(x.message) for x in w)
        a.kill()
        _raises("FAILED_PRECONDITION", a.eval, "1")


def test_exec() -> None:
    with _served() as (_, c):
        (sb,) = c.spawn("py", n=1)
        r = sb.exec(["echo", "a b"], env={"K": "V"}, cwd="/tmp", stdin=b"input")
        assert r.ok and r.exit_code == 0 and r.signal is None and not r.timed_out
        assert r.stdout == b"echo a b\ninput", r.stdout
        assert r.stderr == b"cwd=/tmp env=[('K', 'V')]\n", r.stderr
        r = sb.exec("false")
        assert r.stdout.startswith(b"/bin/sh -c false")
        r = sb.exec(["false"])
        assert r.exit_code == 3 and not r.ok
        r = sb.exec(["kill-me"])
        assert r.exit_code is None and r.signal == 15
        r = sb.exec(["/bin/sh", "-c", "sleep 30"], timeout_s=0.5)
        assert r.timed_out and not r.ok
        _raises("UNKNOWN", sb.exec, ["no-exit"])


def test_files() -> None:
    with _served() as (srv, c):
        (sb,) = c.spawn("py", n=1)
        data = os.urandom(2 * (1 << 20) + 12345)
        assert sb.files.write("/tmp/big", data, mode=0o600) == len(data)
        assert srv.state.write_chunk_sizes == [1 << 20, 1 << 20, 12345]
        assert srv.state.files[(sb.id, "/tmp/big")][0] == 0o600
        assert sb.files.read("/tmp/big") == data
        srv.state.write_chunk_sizes.clear()
        assert sb.files.write("/tmp/empty", b"") == 0
        assert srv.state.write_chunk_sizes == []
        assert sb.files.read("/tmp/empty") == b""
        assert sb.files.write("/tmp/t", "héllo") == 6
        assert sb.files.read("/tmp/t").decode() == "héllo"
        _raises("NOT_FOUND", sb.files.read, "/nope")
        sb.files.write("/truncated", b"x" * 100)
        _raises("DATA_LOSS", sb.files.read, "/truncated")


def test_branch_and_executors() -> None:
    with _served() as (_, c):
        (sb,) = c.spawn("py", n=1)
        snap = sb.branch("mid")
        assert snap.tag == "mid" and snap.parent_tag == "py" and snap.source_sandbox == sb.id
        assert snap.branch is not None and snap.branch.mode == "diff" and snap.branch.pages_written == 12
        assert sb.branch("whole", mode="full").branch.mode == "full"  # type: ignore[union-attr]
        assert sb.branch("lively", mode="live").branch.mode == "live"  # type: ignore[union-attr]
        writing = sb.branch("later", wait=False)
        assert writing.state == "WRITING" and writing.branch is not None and writing.branch.pause_us == 800
        _raises("FAILED_PRECONDITION", c.spawn, "later", wait_for_snapshot=False)
        assert c.wait_snapshot("later", timeout_s=5).state == "READY"
        sb.branch("x-fails", wait=False)
        _raises("FAILED_PRECONDITION", c.wait_snapshot, "x-fails", 5)
        assert c.snapshot("x-fails").error == "disk full"
        try:
            sb.branch("x", mode="sideways")
            raise AssertionError("a bad mode was sent")
        except ValueError as e:
            assert "sideways" in str(e)
        ex = c.executors()
        assert ex[0].id == "ex-1" and ex[0].state == "UP" and ex[0].max_sandboxes == 100
        assert ex[1].state == "7" and ex[1].cached_tags == ("py",)  # a state newer than this client
        drained = c.drain_executor("ex-1")
        assert drained.id == "ex-1" and drained.state == "DRAINING"
        _raises("NOT_FOUND", c.drain_executor, "ex-9")


def test_example_script() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "fork_and_eval.py"
    import runpy

    with FakeServer() as srv, _env(TINE_ADDR=srv.addr, TINE_TOKEN=TOKEN):
        saved = sys.argv
        sys.argv = [str(example), "py"]
        try:
            runpy.run_path(str(example), run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        finally:
            sys.argv = saved
        assert all(s.state == 4 for s in srv.state.sandboxes.values())
        assert len(srv.state.sandboxes) == 3


if __name__ == "__main__":
    _runner.main("test_offline", dict(globals()))
