"""An in-process stand-in for the Tine control plane, for the client's offline tests.

It speaks the real generated protocol (tine.v1) on a loopback port and behaves the way
proto/tine/v1/tine.proto describes, with canned guests: enough to exercise every path
of the client (auth, streaming, per-child spawn failures, chunked files) without VMs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from tine.v1 import tine_pb2 as pb
from tine.v1 import tine_pb2_grpc as pb_grpc

TOKEN = "fake-token"
READ_CHUNK = 300 * 1024
MIB = 1 << 20


def _auth(context: grpc.ServicerContext) -> None:
    md = dict(context.invocation_metadata())
    if md.get("authorization") != f"Bearer {TOKEN}":
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing bearer token")


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.snapshots = {
            "base": pb.Snapshot(tag="base", image="python-numpy", vcpus=1, mem_mib=256, executors=["ex-1"]),
            "py": pb.Snapshot(tag="py", parent_tag="base", image="python-numpy", vcpus=1, mem_mib=256),
            "py-child": pb.Snapshot(tag="py-child", parent_tag="py", source_sandbox="sb-0"),
        }
        self.sandboxes: dict[str, pb.Sandbox] = {}
        self.files: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.globals: dict[str, dict[str, Any]] = {}
        self.write_chunk_sizes: list[int] = []
        self.last_network: Any = None
        self.next_id = 0

    def new_id(self) -> str:
        with self.lock:
            self.next_id += 1
            return f"sb-{self.next_id}"


class Snapshots(pb_grpc.SnapshotsServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    def ListSnapshots(self, request: Any, context: Any) -> Any:
        _auth(context)
        return pb.ListSnapshotsResponse(snapshots=list(self.st.snapshots.values()))

    def GetSnapshot(self, request: Any, context: Any) -> Any:
        _auth(context)
        snap = self.st.snapshots.get(request.tag)
        if snap is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no snapshot {request.tag!r}")
        assert snap is not None
        ancestors = []
        p = snap.parent_tag
        while p:
            ancestors.append(self.st.snapshots[p])
            p = self.st.snapshots[p].parent_tag
        descendants = [s for s in self.st.snapshots.values() if s.parent_tag == snap.tag]
        shown = pb.Snapshot()
        shown.CopyFrom(snap)
        if snap.state == pb.SNAPSHOT_STATE_WRITING:
            failed = snap.tag.endswith("-fails")
            snap.state = pb.SNAPSHOT_STATE_FAILED if failed else pb.SNAPSHOT_STATE_READY
            snap.error = "disk full" if failed else ""
        return pb.GetSnapshotResponse(snapshot=shown, ancestors=ancestors, descendants=descendants)

    def CreateSnapshot(self, request: Any, context: Any) -> Any:
        _auth(context)
        snap = pb.Snapshot(tag=request.tag, image=request.image, vcpus=request.vcpus, mem_mib=request.mem_mib or 512)
        self.st.snapshots[request.tag] = snap
        return snap

    def DeleteSnapshot(self, request: Any, context: Any) -> Any:
        _auth(context)
        if request.tag not in self.st.snapshots:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no snapshot {request.tag!r}")
        kids = [s.tag for s in self.st.snapshots.values() if s.parent_tag == request.tag]
        if kids and not request.cascade:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.tag} has descendants: {kids}")
        gone = [request.tag] + kids
        for t in gone:
            self.st.snapshots.pop(t, None)
        return pb.DeleteSnapshotResponse(deleted=gone)


class Sandboxes(pb_grpc.SandboxesServicer):
    def __init__(self, st: State) -> None:
        self.st = st

    def _get(self, sid: str, context: Any) -> pb.Sandbox:
        sb = self.st.sandboxes.get(sid)
        if sb is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {sid!r}")
        assert sb is not None
        if sb.state != pb.SANDBOX_STATE_READY:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"sandbox {sid} is not running")
        return sb

    def Spawn(self, request: Any, context: Any) -> Iterator[Any]:
        _auth(context)
        if request.count == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "count must be at least 1")
        if request.tag not in self.st.snapshots and request.tag not in ("flaky", "broken-stream"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no snapshot {request.tag!r}")
        self.st.last_network = request.network if request.HasField("network") else None
        snap = self.st.snapshots.get(request.tag)
        if snap is not None and snap.state == pb.SNAPSHOT_STATE_WRITING and request.no_wait:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"snapshot {request.tag} is still being written")
        # Children become ready in reverse order, to check the client re-sorts them.
        for i in reversed(range(request.count)):
            if request.tag == "flaky" and i == 1:
                yield pb.SpawnEvent(
                    index=i,
                    failed=pb.SpawnFailure(
                        sandbox_id="sb-failed", executor="ex-1", code="RESOURCE_EXHAUSTED", message="no memory"
                    ),
                )
                continue
            if request.tag == "broken-stream" and i == 0:
                context.abort(grpc.StatusCode.INTERNAL, "control plane lost its executor")
            sid = self.st.new_id()
            sb = pb.Sandbox(
                id=sid,
                tag=request.tag,
                executor="ex-1" if request.placement.policy == pb.PLACEMENT_POLICY_PACK else f"ex-{i % 2 + 1}",
                state=pb.SANDBOX_STATE_READY,
                created_unix_ms=1_700_000_000_000,
                ready_us=1000 + i,
            )
            if request.sandbox_timeout_s:
                sb.expires_unix_ms = 1_700_000_000_000 + request.sandbox_timeout_s * 1000
            if request.HasField("resources"):
                sb.resources.CopyFrom(request.resources)
            self.st.sandboxes[sid] = sb
            self.st.globals[sid] = {}
            yield pb.SpawnEvent(index=i, ready=sb)

    def ListSandboxes(self, request: Any, context: Any) -> Any:
        _auth(context)
        out = [
            s
            for s in self.st.sandboxes.values()
            if (request.all or s.state == pb.SANDBOX_STATE_READY) and (not request.tag or s.tag == request.tag)
        ]
        # Pages of two, so clients are seen to follow next_page_token (the token: an offset).
        start = int(request.page_token or 0)
        more = start + 2 < len(out)
        return pb.ListSandboxesResponse(
            sandboxes=out[start : start + 2], next_page_token=str(start + 2) if more else ""
        )

    def GetSandbox(self, request: Any, context: Any) -> Any:
        _auth(context)
        sb = self.st.sandboxes.get(request.id)
        if sb is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.id!r}")
        assert sb is not None
        # A running one's cgroup as its executor would count it; an ended one has none.
        out = pb.Sandbox()
        out.CopyFrom(sb)
        if sb.state == pb.SANDBOX_STATE_READY:
            out.usage.CopyFrom(pb.SandboxUsage(memory_current_bytes=3 << 20, memory_max_bytes=128 << 20, cpu_usage_us=250))
        return out

    def SetTimeout(self, request: Any, context: Any) -> Any:
        _auth(context)
        sb = self._get(request.sandbox_id, context)
        if not 1 <= request.timeout_s <= 86_400:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: {request.timeout_s} is outside 1..=86400")
        sb.expires_unix_ms = 1_700_000_000_000 + request.timeout_s * 1000
        return sb

    def ExposePort(self, request: Any, context: Any) -> Any:
        _auth(context)
        self._get(request.sandbox_id, context)
        if not 1 <= request.guest_port <= 65535:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"guest_port: {request.guest_port} is outside 1..=65535")
        return pb.ExposePortResponse(address=f"127.0.0.1:{40000 + request.guest_port % 20000}")

    def KillSandbox(self, request: Any, context: Any) -> Any:
        _auth(context)
        sb = self.st.sandboxes.get(request.id)
        if sb is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.id!r}")
        assert sb is not None
        sb.state = pb.SANDBOX_STATE_KILLED
        return pb.KillSandboxResponse(sandbox=sb)

    def Exec(self, request: Any, context: Any) -> Iterator[Any]:
        _auth(context)
        self._get(request.sandbox_id, context)
        argv = list(request.argv)
        if argv[:2] == ["/bin/sh", "-c"] and argv[2:] == ["sleep 30"] and request.timeout_ms:
            yield pb.ExecEvent(exit=pb.ExitStatus(signal=9, timed_out=True))
            return
        if argv == ["kill-me"]:
            yield pb.ExecEvent(exit=pb.ExitStatus(signal=15))
            return
        if argv == ["no-exit"]:
            yield pb.ExecEvent(stdout=b"partial")
            return
        # echo: argv, env, cwd and stdin, in pieces on both streams
        yield pb.ExecEvent(stdout=(" ".join(argv) + "\n").encode())
        yield pb.ExecEvent(stderr=f"cwd={request.cwd} env={sorted(request.env.items())}\n".encode())
        yield pb.ExecEvent(stdout=request.stdin)
        yield pb.ExecEvent(exit=pb.ExitStatus(code=3 if argv[0] == "false" else 0))

    def Eval(self, request: Any, context: Any) -> Any:
        _auth(context)
        self._get(request.sandbox_id, context)
        g = self.st.globals[request.sandbox_id]
        if request.code == "restart":
            g.clear()
            return pb.EvalResponse(restarted="out of memory")
        try:
            *body, last = request.code.strip().splitlines() or [""]
            exec("\n".join(body), g)  # noqa: S102 - test double only
            try:
                compiled = compile(last, "<eval>", "eval")
            except SyntaxError:
                exec(last, g)  # noqa: S102
                return pb.EvalResponse()
            return pb.EvalResponse(value=repr(eval(compiled, g)))  # noqa: S307
        except Exception as e:
            return pb.EvalResponse(error=f"Traceback (most recent call last):\n{type(e).__name__}: {e}")

    def ReadFile(self, request: Any, context: Any) -> Iterator[Any]:
        _auth(context)
        self._get(request.sandbox_id, context)
        entry = self.st.files.get((request.sandbox_id, request.path))
        if entry is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{request.path}: no such file")
        assert entry is not None
        mode, data = entry
        if request.path == "/truncated":
            yield pb.FileChunk(data=data[:10], mode=mode, size=len(data))
            return
        # Data chunks in order; the last carries mode and size, with data or without.
        chunks = [data[off : off + READ_CHUNK] for off in range(0, len(data), READ_CHUNK)]
        if len(data) % 2 == 0:
            chunks.append(b"")
        for i, c in enumerate(chunks):
            last = i == len(chunks) - 1
            yield pb.FileChunk(data=c, mode=mode if last else 0, size=len(data) if last else 0)
        if not chunks:
            yield pb.FileChunk(mode=mode, size=0)

    def WriteFile(self, request_iterator: Iterator[Any], context: Any) -> Any:
        _auth(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be the header")
        assert first is not None
        h = first.header
        self._get(h.sandbox_id, context)
        parts = []
        for msg in request_iterator:
            if msg.WhichOneof("part") != "data":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a second header")
            if len(msg.data) > MIB:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chunk over 1 MiB")
            self.st.write_chunk_sizes.append(len(msg.data))
            parts.append(msg.data)
        data = b"".join(parts)
        self.st.files[(h.sandbox_id, h.path)] = (h.mode, data)
        return pb.WriteFileResponse(size=len(data))

    def Branch(self, request: Any, context: Any) -> Any:
        _auth(context)
        sb = self._get(request.sandbox_id, context)
        info = pb.BranchInfo(mode=request.mode, pause_us=800, pages_written=12, took_us=900)
        # Without waiting: WRITING, READY once looked at (tag "x-fails": FAILED).
        state = pb.SNAPSHOT_STATE_WRITING if request.no_wait else pb.SNAPSHOT_STATE_READY
        snap = pb.Snapshot(tag=request.tag, parent_tag=sb.tag, source_sandbox=sb.id, branch=info, state=state)
        self.st.snapshots[request.tag] = snap
        return snap


class Executors(pb_grpc.ExecutorsServicer):
    def __init__(self) -> None:
        cap = pb.Capacity(max_sandboxes=100, running_sandboxes=3, mem_total_mib=24000, mem_available_mib=20000)
        self.executors = {
            "ex-1": pb.Executor(id="ex-1", addr="127.0.0.1:7071", state=pb.EXECUTOR_STATE_UP, capacity=cap),
            # A state value newer than the client knows.
            "ex-2": pb.Executor(id="ex-2", addr="127.0.0.1:7072", state=7, cached_tags=["py"]),  # type: ignore[arg-type]
        }

    def ListExecutors(self, request: Any, context: Any) -> Any:
        _auth(context)
        out = list(self.executors.values())
        start = int(request.page_token or 0)
        more = start + 1 < len(out)
        return pb.ListExecutorsResponse(
            executors=out[start : start + 1], next_page_token=str(start + 1) if more else ""
        )

    def DrainExecutor(self, request: Any, context: Any) -> Any:
        _auth(context)
        ex = self.executors.get(request.id)
        if ex is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no executor {request.id!r}")
        assert ex is not None
        ex.state = pb.EXECUTOR_STATE_DRAINING
        return ex

    def RegisterExecutor(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "the fake has no executors to register")

    def Heartbeat(self, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "the fake has no executors to register")


class FakeServer:
    """``with FakeServer() as srv:`` serves on ``srv.addr`` (127.0.0.1:<free port>)."""

    def __init__(self) -> None:
        self.state = State()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_SnapshotsServicer_to_server(Snapshots(self.state), self.server)
        pb_grpc.add_SandboxesServicer_to_server(Sandboxes(self.state), self.server)
        pb_grpc.add_ExecutorsServicer_to_server(Executors(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = f"127.0.0.1:{port}"

    def __enter__(self) -> FakeServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)
