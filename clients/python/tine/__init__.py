"""Python client for Tine (fork(2) for microVMs).

    import tine
    client = tine.Client()          # $TINE_ADDR (127.0.0.1:7070), $TINE_TOKEN
    sandboxes = client.spawn("py", n=3)

The raw generated gRPC modules are ``tine.v1.tine_pb2`` and ``tine.v1.tine_pb2_grpc``.
"""

from tine.client import (
    DEFAULT_ADDR,
    BranchInfo,
    Client,
    EvalResult,
    ExecResult,
    Executor,
    Files,
    Sandbox,
    Snapshot,
    SpawnEvent,
    Usage,
    resolve_addr,
    resolve_token,
)
from tine.errors import EvalError, SpawnError, SpawnFailure, TineError

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ADDR",
    "BranchInfo",
    "Client",
    "EvalError",
    "EvalResult",
    "ExecResult",
    "Executor",
    "Files",
    "Sandbox",
    "Snapshot",
    "SpawnError",
    "SpawnEvent",
    "SpawnFailure",
    "TineError",
    "Usage",
    "resolve_addr",
    "resolve_token",
]
