"""A small, typed layer over Tine's gRPC API (proto/tine/v1/tine.proto).

    import tine

    client = tine.Client()                      # TINE_ADDR, TINE_TOKEN / TINE_TOKEN_FILE
    for sb in client.spawn("py", n=3):
        with sb:                                # killed on exit
            print(sb.id, sb.eval("1 + 1"))      # '2'

Every failed call raises ``TineError`` (``.code`` is the gRPC status code name).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc

from tine.errors import EvalError, SpawnError, SpawnFailure, TineError

try:
    from tine.v1 import tine_pb2 as pb
    from tine.v1 import tine_pb2_grpc as pb_grpc
except ImportError as _e:  # pragma: no cover - only without generated stubs
    raise ImportError(
        "tine: the generated gRPC stubs (tine/v1/tine_pb2*.py) are missing; "
        "run clients/python/generate.sh, then reinstall the package"
    ) from _e

__all__ = [
    "DEFAULT_ADDR",
    "Client",
    "EvalResult",
    "ExecResult",
    "Executor",
    "Files",
    "Sandbox",
    "Snapshot",
    "SpawnEvent",
    "resolve_addr",
    "resolve_token",
]

DEFAULT_ADDR = "127.0.0.1:7070"
DEFAULT_PORT = 7070
# WriteFile data chunk size (the server's limit per message is larger).
CHUNK_SIZE = 1 << 20
_MAX_MESSAGE = 64 << 20
# Extra gRPC deadline on top of a server-side timeout, so the server's answer wins.
_DEADLINE_GRACE_S = 30.0
_UINT32_MAX = (1 << 32) - 1

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


# ---------------------------------------------------------------------------------------
# Configuration: address, TLS, token


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_addr(addr: str | None = None) -> tuple[str, bool | None]:
    """Turn an address into a gRPC target and whether to use TLS.

    Accepts ``host:port``, ``host`` (port 7070), ``[v6]:port``, ``http://host:port``
    (plaintext), ``https://host:port`` (TLS) and ``unix:/path`` (plaintext). ``None``
    reads ``TINE_ADDR`` (default ``127.0.0.1:7070``). The second value is True/False
    when the address says so (scheme, unix socket) and None when it does not (the
    client then uses plaintext on loopback, TLS otherwise).
    """
    raw = addr if addr is not None else os.environ.get("TINE_ADDR", "")
    raw = raw.strip() or DEFAULT_ADDR
    if raw.startswith(("unix:", "unix-abstract:")):
        return raw, False
    tls: bool | None = None
    rest = raw
    if "://" in raw:
        scheme, rest = raw.split("://", 1)
        scheme = scheme.lower()
        if scheme in ("http", "grpc"):
            tls = False
        elif scheme in ("https", "grpcs"):
            tls = True
        else:
            raise ValueError(f"tine: unsupported scheme in address {raw!r} (use http:// or https://)")
        rest = rest.rstrip("/")
        if "/" in rest:
            raise ValueError(f"tine: address {raw!r} has a path; give host:port only")
    if not rest:
        raise ValueError(f"tine: empty host in address {raw!r}")
    if rest.startswith("["):  # [v6] or [v6]:port
        end = rest.find("]")
        if end < 0:
            raise ValueError(f"tine: bad IPv6 address {raw!r}")
        host, tail = rest[1:end], rest[end + 1 :]
        if tail and not tail.startswith(":"):
            raise ValueError(f"tine: bad address {raw!r}")
        port = tail[1:] if tail else str(DEFAULT_PORT)
    elif rest.count(":") > 1:  # a bare IPv6 address, no port
        host, port = rest, str(DEFAULT_PORT)
    elif ":" in rest:
        host, port = rest.rsplit(":", 1)
    else:
        host, port = rest, str(DEFAULT_PORT)
    if not host:
        raise ValueError(f"tine: empty host in address {raw!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"tine: bad port in address {raw!r}")
    target_host = f"[{host}]" if ":" in host else host
    return f"{target_host}:{port}", tls


def data_dir() -> Path:
    """``$TINE_DATA_DIR``, else ``$XDG_DATA_HOME/tine``, else ``~/.local/share/tine``."""
    d = os.environ.get("TINE_DATA_DIR")
    if d:
        return Path(d)
    x = os.environ.get("XDG_DATA_HOME")
    if x:
        return Path(x) / "tine"
    return Path.home() / ".local" / "share" / "tine"


def _read_token_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TineError("UNAUTHENTICATED", f"cannot read token file {path}: {e.strerror or e}") from None
    if not token:
        raise TineError("UNAUTHENTICATED", f"token file {path} is empty")
    return token


def resolve_token(token: str | None = None) -> str:
    """The bearer token: ``token``, else ``TINE_TOKEN``, else the file named by
    ``TINE_TOKEN_FILE``, else ``<data dir>/admin.token`` (see ``data_dir``)."""
    if token is None:
        env = os.environ.get("TINE_TOKEN", "").strip()
        if env:
            token = env
        elif os.environ.get("TINE_TOKEN_FILE"):
            token = _read_token_file(Path(os.environ["TINE_TOKEN_FILE"]).expanduser())
        else:
            default = data_dir() / "admin.token"
            if not default.exists():
                raise TineError(
                    "UNAUTHENTICATED",
                    f"no token: pass token=, set TINE_TOKEN or TINE_TOKEN_FILE, or create {default}",
                )
            token = _read_token_file(default)
    token = token.strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError("tine: the token must be non-empty printable text without spaces")
    return token


def _read_ca(tls_ca: str | os.PathLike[str] | bytes | None) -> bytes | None:
    if tls_ca is None:
        env = os.environ.get("TINE_TLS_CA")
        if not env:
            return None
        tls_ca = env
    if isinstance(tls_ca, bytes):
        return tls_ca
    try:
        return Path(tls_ca).expanduser().read_bytes()
    except OSError as e:
        raise TineError("UNAVAILABLE", f"cannot read TLS CA file {tls_ca}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------
# Plain-data results


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    return name[len(prefix) :] if name.startswith(prefix) else name


@dataclass(frozen=True)
class Snapshot:
    """A warm parent. ``ancestors`` (nearest first) and ``descendants`` are filled only
    by ``Client.snapshot(tag)``."""

    tag: str
    parent_tag: str
    image: str
    vcpus: int
    mem_mib: int
    created_unix_ms: int
    executors: tuple[str, ...]
    source_sandbox: str
    ancestors: tuple[Snapshot, ...] = ()
    descendants: tuple[Snapshot, ...] = ()
    #: How it was made, in the answer to ``Sandbox.branch`` only.
    branch: BranchInfo | None = None
    #: ``"READY"``, ``"WRITING"`` (a branch taken with ``wait=False``, still being written)
    #: or ``"FAILED"`` (then ``error`` says why).
    state: str = "READY"
    error: str = ""

    @classmethod
    def _from_pb(cls, s: pb.Snapshot) -> Snapshot:
        return cls(
            tag=s.tag,
            parent_tag=s.parent_tag,
            image=s.image,
            vcpus=s.vcpus,
            mem_mib=s.mem_mib,
            created_unix_ms=s.created_unix_ms,
            executors=tuple(s.executors),
            source_sandbox=s.source_sandbox,
            branch=BranchInfo._from_pb(s.branch) if s.HasField("branch") else None,
            state=_SNAPSHOT_STATES.get(s.state, str(s.state)),
            error=s.error,
        )


_SNAPSHOT_STATES = {
    pb.SNAPSHOT_STATE_UNSPECIFIED: "READY",
    pb.SNAPSHOT_STATE_READY: "READY",
    pb.SNAPSHOT_STATE_WRITING: "WRITING",
    pb.SNAPSHOT_STATE_FAILED: "FAILED",
}


@dataclass(frozen=True)
class BranchInfo:
    """How a branch was taken: ``mode`` (``"diff"``, ``"live"`` or ``"full"``), how long the
    sandbox was paused, the pages the branch holds (written since the sandbox's previous
    branch, or its fork), the whole call on the executor, and the second, short pause in
    which the sandbox was rebased onto the branch (0 for full branches)."""

    mode: str
    pause_us: int
    pages_written: int
    took_us: int
    rebase_pause_us: int = 0

    @classmethod
    def _from_pb(cls, b: pb.BranchInfo) -> BranchInfo:
        names = {pb.BRANCH_MODE_DIFF: "diff", pb.BRANCH_MODE_FULL: "full", pb.BRANCH_MODE_LIVE: "live"}
        return cls(
            mode=names.get(b.mode, str(b.mode)),
            pause_us=b.pause_us,
            pages_written=b.pages_written,
            took_us=b.took_us,
            rebase_pause_us=b.rebase_pause_us,
        )


@dataclass(frozen=True)
class Executor:
    """An executor host. ``state`` is UP, DRAINING or DOWN."""

    id: str
    addr: str
    state: str
    max_sandboxes: int
    running_sandboxes: int
    mem_total_mib: int
    mem_available_mib: int
    last_heartbeat_unix_ms: int
    cached_tags: tuple[str, ...]

    @classmethod
    def _from_pb(cls, e: pb.Executor) -> Executor:
        c = e.capacity
        return cls(
            id=e.id,
            addr=e.addr,
            state=_enum_name(pb.ExecutorState, e.state, "EXECUTOR_STATE_"),
            max_sandboxes=c.max_sandboxes,
            running_sandboxes=c.running_sandboxes,
            mem_total_mib=c.mem_total_mib,
            mem_available_mib=c.mem_available_mib,
            last_heartbeat_unix_ms=e.last_heartbeat_unix_ms,
            cached_tags=tuple(e.cached_tags),
        )


@dataclass(frozen=True)
class ExecResult:
    """How a command ended: ``exit_code`` or ``signal`` (the other is None)."""

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class EvalResult:
    """Everything ``Sandbox.eval`` got back. ``value`` is the repr() of the final
    expression (None when there was none); ``error`` the traceback when the code raised;
    ``restarted`` is set when the interpreter was restarted and lost its globals."""

    value: str | None
    stdout: str
    stderr: str
    error: str | None
    restarted: str | None


@dataclass(frozen=True)
class SpawnEvent:
    """One child of a spawn: ``sandbox`` when it became ready, else ``failure``."""

    index: int
    sandbox: Sandbox | None = None
    failure: SpawnFailure | None = None

    @property
    def ok(self) -> bool:
        return self.sandbox is not None


# ---------------------------------------------------------------------------------------
# Sandboxes


class Files:
    """File access inside one sandbox (``sandbox.files``)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def read(self, path: str) -> bytes:
        """The whole file at ``path`` in the sandbox."""
        client = self._sb._client
        req = pb.ReadFileRequest(sandbox_id=self._sb.id, path=path)
        parts: list[bytes] = []
        # The file's size rides on one chunk (the last; its data may be empty).
        announced = 0
        for chunk in client._stream(client._sandboxes.ReadFile, req, None):
            announced = max(announced, chunk.size)
            if chunk.data:
                parts.append(chunk.data)
        data = b"".join(parts)
        if len(data) < announced:
            raise TineError("DATA_LOSS", f"read {path}: got {len(data)} of {announced} bytes")
        return data

    def write(self, path: str, data: bytes | bytearray | memoryview | str, mode: int = 0o644) -> int:
        """Create or replace ``path`` in the sandbox; returns the size written."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        if not 0 <= mode <= 0o7777:
            raise ValueError(f"tine: bad file mode {mode:o}")
        view = memoryview(data).cast("B")
        header = pb.WriteFileHeader(sandbox_id=self._sb.id, path=path, mode=mode)

        def requests() -> Iterator[pb.WriteFileRequest]:
            yield pb.WriteFileRequest(header=header)
            for off in range(0, len(view), CHUNK_SIZE):
                yield pb.WriteFileRequest(data=bytes(view[off : off + CHUNK_SIZE]))

        client = self._sb._client
        resp = client._upload(client._sandboxes.WriteFile, requests(), None)
        return resp.size


def _network(internet: bool | None, allow: Sequence[str], deny: Sequence[str]) -> pb.Network | None:
    """The spawn's network request; None (the executor's default) when nothing is asked."""
    if internet is None and not allow and not deny:
        return None
    if isinstance(allow, str) or isinstance(deny, str):
        raise TypeError("tine: allow and deny are lists of CIDR[:port] strings")
    want = {None: pb.INTERNET_DEFAULT, True: pb.INTERNET_ALLOW, False: pb.INTERNET_DENY}[internet]
    return pb.Network(internet=want, allow=list(allow), deny=list(deny))


@dataclass(frozen=True)
class Usage:
    """What a sandbox's cgroup on its executor counts."""

    memory_current_bytes: int
    """Its VMM and the guest pages it wrote (the snapshot's shared pages are the executor's)."""
    memory_peak_bytes: int
    memory_max_bytes: int
    cpu_usage_us: int
    cpu_throttled_periods: int

    @classmethod
    def _from_pb(cls, u: pb.SandboxUsage) -> Usage:
        return cls(
            memory_current_bytes=u.memory_current_bytes,
            memory_peak_bytes=u.memory_peak_bytes,
            memory_max_bytes=u.memory_max_bytes,
            cpu_usage_us=u.cpu_usage_us,
            cpu_throttled_periods=u.cpu_throttled_periods,
        )


class Sandbox:
    """A running child of a snapshot. Use as a context manager to kill it on exit."""

    def __init__(self, client: Client, s: pb.Sandbox) -> None:
        self._client = client
        self._killed = False
        self.files = Files(self)
        self._update(s)

    def _update(self, s: pb.Sandbox) -> None:
        self.id: str = s.id
        self.tag: str = s.tag
        self.executor: str = s.executor
        self.state: str = _enum_name(pb.SandboxState, s.state, "SANDBOX_STATE_")
        self.created_unix_ms: int = s.created_unix_ms
        self.ready_us: int = s.ready_us
        """Spawn-to-ready as the executor measured it, in microseconds."""
        self.error: str = s.error
        """Why it ended (FAILED, LOST), e.g. "out of memory: ..."; "" while it runs."""
        self.memory_limit_mib: int = s.resources.memory_limit_mib
        """The memory limit its spawn asked for (0: the executor's default)."""
        self.cpu_millis: int = s.resources.cpu_millis
        """The CPU share its spawn asked for, in thousandths of a core (0: unlimited)."""
        self.expires_unix_ms: int = s.expires_unix_ms
        """When its timeout runs out and the control plane kills it (0: never)."""
        self.usage: Usage | None = Usage._from_pb(s.usage) if s.HasField("usage") else None
        """What its cgroup counted when last read (``refresh()``); None until then, once it
        ended, or on an executor without cgroups."""

    def __repr__(self) -> str:
        return (
            f"Sandbox(id={self.id!r}, tag={self.tag!r}, executor={self.executor!r}, "
            f"state={self.state}, ready_us={self.ready_us})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sandbox) and other.id == self.id and other._client is self._client

    def __hash__(self) -> int:
        return hash(self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._killed:
            return
        try:
            self.kill()
        except TineError as e:
            # Already gone is fine; and never hide the exception that ended the block.
            if e.code != "NOT_FOUND" and exc_type is None:
                raise

    def exec(
        self,
        argv: Sequence[str] | str,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str = b"",
        timeout_s: float | None = None,
    ) -> ExecResult:
        """Run a command and wait for it. A string ``argv`` runs through ``/bin/sh -c``."""
        args = ["/bin/sh", "-c", argv] if isinstance(argv, str) else list(argv)
        if not args:
            raise ValueError("tine: exec needs a command")
        req = pb.ExecRequest(
            sandbox_id=self.id,
            argv=args,
            env=dict(env or {}),
            cwd=cwd or "",
            stdin=stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin),
            timeout_ms=_ms(timeout_s),
        )
        out: list[bytes] = []
        err: list[bytes] = []
        status: pb.ExitStatus | None = None
        for ev in self._client._stream(self._client._sandboxes.Exec, req, _deadline(timeout_s)):
            kind = ev.WhichOneof("event")
            if kind == "stdout":
                out.append(ev.stdout)
            elif kind == "stderr":
                err.append(ev.stderr)
            elif kind == "exit":
                status = ev.exit
        if status is None:
            raise TineError("UNKNOWN", "exec: the stream ended without an exit status")
        how = status.WhichOneof("how")
        return ExecResult(
            exit_code=status.code if how == "code" else None,
            signal=status.signal if how == "signal" else None,
            timed_out=status.timed_out,
            stdout=b"".join(out),
            stderr=b"".join(err),
        )

    def eval_result(self, code: str, timeout_s: float | None = None) -> EvalResult:
        """Run Python in the sandbox's warm interpreter; never raises ``EvalError``."""
        req = pb.EvalRequest(sandbox_id=self.id, code=code, timeout_ms=_ms(timeout_s))
        r = self._client._unary(self._client._sandboxes.Eval, req, _deadline(timeout_s))
        return EvalResult(
            value=r.value if r.HasField("value") else None,
            stdout=r.stdout,
            stderr=r.stderr,
            error=r.error if r.HasField("error") else None,
            restarted=r.restarted if r.HasField("restarted") else None,
        )

    def eval(self, code: str, timeout_s: float | None = None) -> str | None:
        """Run Python in the sandbox's warm interpreter and return the repr() of the
        final expression (None when there is none). Raises ``EvalError`` with the
        guest's traceback when the code raised."""
        r = self.eval_result(code, timeout_s)
        if r.restarted is not None:
            warnings.warn(
                f"tine: sandbox {self.id}: interpreter restarted, globals lost: {r.restarted}",
                RuntimeWarning,
                stacklevel=2,
            )
        if r.error is not None:
            raise EvalError(r.error, r.stdout, r.stderr)
        return r.value

    def expose_port(self, guest_port: int) -> str:
        """Forward a port of the sandbox's executor host to TCP ``guest_port`` of the guest
        (a server started in it); returns "host:port". Closed when the sandbox ends."""
        req = pb.ExposePortRequest(sandbox_id=self.id, guest_port=guest_port)
        return self._client._unary(self._client._sandboxes.ExposePort, req).address

    def kill(self) -> None:
        """Kill the sandbox (its state becomes KILLED)."""
        r = self._client._unary(self._client._sandboxes.KillSandbox, pb.KillSandboxRequest(id=self.id))
        self._killed = True
        if r.HasField("sandbox"):
            self._update(r.sandbox)

    def set_timeout(self, seconds: int) -> Sandbox:
        """Have the control plane kill this sandbox ``seconds`` from now (extend or shorten
        its timeout; 1 up to the operator's maximum)."""
        req = pb.SetTimeoutRequest(sandbox_id=self.id, timeout_s=seconds)
        self._update(self._client._unary(self._client._sandboxes.SetTimeout, req))
        return self

    def refresh(self) -> Sandbox:
        """Re-read the sandbox's state from the control plane."""
        self._update(self._client._unary(self._client._sandboxes.GetSandbox, pb.GetSandboxRequest(id=self.id)))
        return self

    def branch(self, tag: str, mode: str = "diff", wait: bool = True) -> Snapshot:
        """Snapshot this running sandbox as a child snapshot ``tag``; the sandbox runs on
        and children of ``tag`` start from this instant. ``mode``: ``"diff"`` (the pages
        written since the fork, over its snapshot), ``"live"`` (the same, copied after the
        sandbox resumes: the shortest pause) or ``"full"`` (a complete image).
        ``wait=False`` returns as soon as the sandbox resumes, with the snapshot WRITING;
        spawns from it wait until it is READY (``Client.wait_snapshot`` waits too)."""
        modes = {"diff": pb.BRANCH_MODE_DIFF, "full": pb.BRANCH_MODE_FULL, "live": pb.BRANCH_MODE_LIVE}
        if mode not in modes:
            raise ValueError(f"tine: branch mode {mode!r}: use one of {sorted(modes)}")
        req = pb.BranchRequest(sandbox_id=self.id, tag=tag, mode=modes[mode], no_wait=not wait)
        return Snapshot._from_pb(self._client._unary(self._client._sandboxes.Branch, req, None))


def _ms(timeout_s: float | None) -> int:
    if timeout_s is None or timeout_s == 0:
        return 0
    if timeout_s < 0 or math.isnan(timeout_s):
        raise ValueError(f"tine: bad timeout {timeout_s}")
    return min(max(1, math.ceil(timeout_s * 1000)), _UINT32_MAX)


def _deadline(timeout_s: float | None) -> float | None:
    return None if not timeout_s else timeout_s + _DEADLINE_GRACE_S


_POLICIES = {
    "": pb.PLACEMENT_POLICY_UNSPECIFIED,
    "spread": pb.PLACEMENT_POLICY_SPREAD,
    "pack": pb.PLACEMENT_POLICY_PACK,
}


# ---------------------------------------------------------------------------------------
# The client


class Client:
    """A connection to a Tine control plane.

    ``addr``: ``host:port``, ``http://host:port`` or ``https://host:port``; default
    ``$TINE_ADDR`` or ``127.0.0.1:7070``. Plaintext on loopback, TLS otherwise (unless the
    scheme says). ``token``: default ``$TINE_TOKEN``, the file ``$TINE_TOKEN_FILE``, or
    ``<data dir>/admin.token``. ``tls_ca``: a PEM file path or PEM bytes to trust instead
    of the system roots (default ``$TINE_TLS_CA``; giving one implies TLS for a bare
    ``host:port``). ``call_timeout_s``: deadline for the short calls (list, get, kill,
    delete); spawn, exec, eval, files and snapshot creation are not limited by it.
    ``allow_plaintext_remote``: send the token in clear to a non-loopback ``http://`` address
    (default ``$TINE_ALLOW_PLAINTEXT_REMOTE == "1"``); otherwise such a client is refused.
    """

    def __init__(
        self,
        addr: str | None = None,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | bytes | None = None,
        *,
        call_timeout_s: float | None = None,
        allow_plaintext_remote: bool | None = None,
    ) -> None:
        self.target, tls = resolve_addr(addr)
        self._metadata = (("authorization", f"Bearer {resolve_token(token)}"),)
        ca = _read_ca(tls_ca)
        self.tls = tls if tls is not None else ca is not None or not _is_loopback_target(self.target)
        if allow_plaintext_remote is None:
            allow_plaintext_remote = os.environ.get("TINE_ALLOW_PLAINTEXT_REMOTE") == "1"
        if not self.tls and not allow_plaintext_remote and not _is_loopback_target(self.target):
            raise TineError(
                "INVALID_ARGUMENT",
                f"refusing to send the token in clear to {self.target}: use https://, or "
                "allow_plaintext_remote=True (TINE_ALLOW_PLAINTEXT_REMOTE=1) on a trusted network",
            )
        self.call_timeout_s = call_timeout_s
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
        ]
        if self.tls:
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self._channel = grpc.secure_channel(self.target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=options)
        self._snapshots = pb_grpc.SnapshotsStub(self._channel)
        self._sandboxes = pb_grpc.SandboxesStub(self._channel)
        self._executors = pb_grpc.ExecutorsStub(self._channel)

    def __repr__(self) -> str:
        return f"Client(target={self.target!r}, tls={self.tls})"

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- plumbing: every grpc.RpcError becomes a TineError --------------------------------

    _DEFAULT: Any = object()

    def _unary(
        self,
        fn: grpc.UnaryUnaryMultiCallable[_Req, _Resp],
        req: _Req,
        timeout: float | None = _DEFAULT,
    ) -> _Resp:
        if timeout is Client._DEFAULT:
            timeout = self.call_timeout_s
        try:
            return fn(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise TineError.from_rpc(e) from None

    def _upload(
        self,
        fn: grpc.StreamUnaryMultiCallable[_Req, _Resp],
        reqs: Iterator[_Req],
        timeout: float | None,
    ) -> _Resp:
        try:
            return fn(reqs, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise TineError.from_rpc(e) from None

    def _stream(
        self,
        fn: grpc.UnaryStreamMultiCallable[_Req, _Resp],
        req: _Req,
        timeout: float | None,
    ) -> Iterator[_Resp]:
        try:
            call = fn(req, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise TineError.from_rpc(e) from None
        try:
            yield from call
        except grpc.RpcError as e:
            raise TineError.from_rpc(e) from None
        finally:
            # Stops the server's work when the caller leaves the loop early.
            # (getattr: grpc-stubs leave Call.cancel untyped.)
            cancel = getattr(call, "cancel", None)
            if callable(cancel):
                cancel()

    # -- snapshots --------------------------------------------------------------------------

    def snapshots(self) -> list[Snapshot]:
        """All snapshots."""
        r = self._unary(self._snapshots.ListSnapshots, pb.ListSnapshotsRequest())
        return [Snapshot._from_pb(s) for s in r.snapshots]

    def wait_snapshot(self, tag: str, timeout_s: float = 600.0, poll_s: float = 0.05) -> Snapshot:
        """Wait until snapshot ``tag`` is no longer WRITING and return it. Raises
        ``TineError`` with FAILED_PRECONDITION (and the reason) if its branch failed, or
        DEADLINE_EXCEEDED if it is still being written after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            snap = self.snapshot(tag)
            if snap.state == "FAILED":
                raise TineError("FAILED_PRECONDITION", f"snapshot {tag!r} failed: {snap.error}")
            if snap.state != "WRITING":
                return snap
            if time.monotonic() >= end:
                raise TineError("DEADLINE_EXCEEDED", f"snapshot {tag!r} still being written after {timeout_s} s")
            time.sleep(poll_s)

    def snapshot(self, tag: str) -> Snapshot:
        """One snapshot, with its ancestors (nearest first) and all its descendants."""
        r = self._unary(self._snapshots.GetSnapshot, pb.GetSnapshotRequest(tag=tag))
        return dataclasses.replace(
            Snapshot._from_pb(r.snapshot),
            ancestors=tuple(Snapshot._from_pb(s) for s in r.ancestors),
            descendants=tuple(Snapshot._from_pb(s) for s in r.descendants),
        )

    def create_snapshot(
        self,
        tag: str,
        image: str,
        warmup: Iterable[str] | str = (),
        vcpus: int = 1,
        mem_mib: int = 0,
        executor: str = "",
    ) -> Snapshot:
        """Boot ``image``, run the ``warmup`` Python snippets in its interpreter, snapshot
        it as ``tag``. ``mem_mib=0`` takes the image's recommendation."""
        req = pb.CreateSnapshotRequest(
            tag=tag,
            image=image,
            vcpus=vcpus,
            mem_mib=mem_mib,
            warmup_eval=[warmup] if isinstance(warmup, str) else list(warmup),
            executor=executor,
        )
        return Snapshot._from_pb(self._unary(self._snapshots.CreateSnapshot, req, None))

    def delete_snapshot(self, tag: str, cascade: bool = False) -> list[str]:
        """Delete a snapshot (and with ``cascade`` its descendants); returns the tags deleted."""
        r = self._unary(self._snapshots.DeleteSnapshot, pb.DeleteSnapshotRequest(tag=tag, cascade=cascade))
        return list(r.deleted)

    # -- sandboxes --------------------------------------------------------------------------

    def iter_spawn(
        self,
        tag: str,
        n: int = 1,
        policy: str = "spread",
        timeout_s: float | None = None,
        *,
        executors: Sequence[str] = (),
        memory_limit_mib: int = 0,
        cpu_millis: int = 0,
        lifetime_s: int = 0,
        wait_for_snapshot: bool = True,
        internet: bool | None = None,
        allow: Sequence[str] = (),
        deny: Sequence[str] = (),
    ) -> Iterator[SpawnEvent]:
        """Fork ``n`` children of snapshot ``tag``; yields one ``SpawnEvent`` per child as
        it becomes ready or fails, in that order (not by index).

        ``policy``: "spread" (balance across executors) or "pack" (fill one first);
        ``timeout_s``: per-child readiness deadline (None: the server's default);
        ``memory_limit_mib``/``cpu_millis``: what each child's cgroup holds it to (0: the
        executor's defaults); ``lifetime_s``: seconds each child lives before the control
        plane kills it (0: the operator's default; ``Sandbox.set_timeout`` moves it);
        ``executors``: only these executors; ``wait_for_snapshot=False``: fail with
        FAILED_PRECONDITION instead of waiting when ``tag`` is still being written.
        ``internet``: let the children reach the internet (None: the executor's default);
        ``allow``/``deny``: "CIDR[:port]" entries reachable even with the internet denied /
        never reachable (deny wins). The executor's own addresses and other sandboxes are
        never reachable.
        Leaving the loop early cancels the stream; children already yielded keep running.
        """
        if n < 0:
            raise ValueError(f"tine: spawn count must be >= 0, not {n}")
        try:
            pol = _POLICIES[policy.lower()]
        except KeyError:
            raise ValueError(f"tine: unknown placement policy {policy!r} (spread or pack)") from None
        req = pb.SpawnRequest(
            tag=tag,
            count=n,
            resources=pb.Resources(memory_limit_mib=memory_limit_mib, cpu_millis=cpu_millis),
            placement=pb.Placement(policy=pol, executors=list(executors)),
            ready_timeout_ms=_ms(timeout_s),
            no_wait=not wait_for_snapshot,
            network=_network(internet, allow, deny),
            sandbox_timeout_s=lifetime_s,
        )
        for ev in self._stream(self._sandboxes.Spawn, req, None):
            kind = ev.WhichOneof("result")
            if kind == "ready":
                yield SpawnEvent(index=ev.index, sandbox=Sandbox(self, ev.ready))
            elif kind == "failed":
                f = ev.failed
                yield SpawnEvent(
                    index=ev.index,
                    failure=SpawnFailure(ev.index, f.sandbox_id, f.executor, f.code or "UNKNOWN", f.message),
                )
            else:
                yield SpawnEvent(
                    index=ev.index,
                    failure=SpawnFailure(ev.index, "", "", "UNKNOWN", "spawn event carried no result"),
                )

    def spawn(
        self,
        tag: str,
        n: int = 1,
        policy: str = "spread",
        timeout_s: float | None = None,
        *,
        executors: Sequence[str] = (),
        memory_limit_mib: int = 0,
        cpu_millis: int = 0,
        lifetime_s: int = 0,
        wait_for_snapshot: bool = True,
        internet: bool | None = None,
        allow: Sequence[str] = (),
        deny: Sequence[str] = (),
    ) -> list[Sandbox]:
        """Fork ``n`` children of snapshot ``tag`` and wait for all of them; returns them
        in request order. Raises ``SpawnError`` if any child failed: its ``failures`` say
        why, its ``sandboxes`` are the children that are ready (and still running)."""
        ready: dict[int, Sandbox] = {}
        failures: list[SpawnFailure] = []
        try:
            for ev in self.iter_spawn(
                tag,
                n,
                policy,
                timeout_s,
                executors=executors,
                memory_limit_mib=memory_limit_mib,
                cpu_millis=cpu_millis,
                lifetime_s=lifetime_s,
                wait_for_snapshot=wait_for_snapshot,
                internet=internet,
                allow=allow,
                deny=deny,
            ):
                if ev.sandbox is not None:
                    ready[ev.index] = ev.sandbox
                elif ev.failure is not None:
                    failures.append(ev.failure)
        except TineError as e:
            if not ready and not failures:
                raise
            raise SpawnError(
                e.code,
                f"spawn of {tag!r} broke off after {len(ready) + len(failures)} of {n} children: {e.message}",
                sorted(failures, key=lambda f: f.index),
                [ready[i] for i in sorted(ready)],
            ) from None
        sandboxes = [ready[i] for i in sorted(ready)]
        if failures:
            failures.sort(key=lambda f: f.index)
            shown = "; ".join(str(f) for f in failures[:5])
            more = f"; and {len(failures) - 5} more" if len(failures) > 5 else ""
            raise SpawnError(
                failures[0].code,
                f"{len(failures)} of {n} children of {tag!r} failed: {shown}{more}",
                failures,
                sandboxes,
            )
        if len(sandboxes) < n:
            raise SpawnError(
                "UNKNOWN",
                f"spawn of {tag!r}: the server reported {len(sandboxes)} of {n} children",
                [],
                sandboxes,
            )
        return sandboxes

    def sandboxes(self, all: bool = False, tag: str = "") -> list[Sandbox]:
        """Running sandboxes (``all``: also killed, failed and lost ones), optionally of one
        snapshot ``tag``."""
        out: list[Sandbox] = []
        token = ""
        while True:
            r = self._unary(
                self._sandboxes.ListSandboxes,
                pb.ListSandboxesRequest(tag=tag, all=all, page_token=token),
            )
            out.extend(Sandbox(self, s) for s in r.sandboxes)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    def sandbox(self, id: str) -> Sandbox:
        """A handle on an existing sandbox, by id."""
        return Sandbox(self, self._unary(self._sandboxes.GetSandbox, pb.GetSandboxRequest(id=id)))

    # -- executors --------------------------------------------------------------------------

    def executors(self) -> list[Executor]:
        """The executor hosts (needs an admin token)."""
        out: list[Executor] = []
        token = ""
        while True:
            r = self._unary(self._executors.ListExecutors, pb.ListExecutorsRequest(page_token=token))
            out.extend(Executor._from_pb(e) for e in r.executors)
            if not r.next_page_token:
                return out
            token = r.next_page_token

    def drain_executor(self, id: str) -> Executor:
        """Stop placing new sandboxes on an executor; its running sandboxes stay."""
        return Executor._from_pb(self._unary(self._executors.DrainExecutor, pb.DrainExecutorRequest(id=id)))


def _is_loopback_target(target: str) -> bool:
    host = target.rsplit(":", 1)[0]
    return _is_loopback(host.strip("[]"))
