"""Exceptions raised by the Tine client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from tine.client import Sandbox


class TineError(Exception):
    """A call to the Tine API failed.

    ``code`` is the gRPC status code name (``"NOT_FOUND"``, ``"UNAUTHENTICATED"``,
    ``"UNAVAILABLE"``...) and ``message`` the server's (or gRPC's) explanation.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message

    @property
    def status(self) -> grpc.StatusCode | None:
        """The ``grpc.StatusCode`` for ``code``, or None for a code gRPC does not know."""
        return grpc.StatusCode.__members__.get(self.code)

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> TineError:
        """Convert a ``grpc.RpcError`` (which is also a ``grpc.Call`` for real RPCs)."""
        code_fn = getattr(err, "code", None)
        details_fn = getattr(err, "details", None)
        status = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        name = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
        return cls(name, str(details) if details is not None else str(err))


@dataclass(frozen=True)
class SpawnFailure:
    """One child of a spawn that did not become ready."""

    index: int
    """0-based position of the child in the request."""
    sandbox_id: str
    executor: str
    """"" when no executor could take it."""
    code: str
    """gRPC status code name, e.g. RESOURCE_EXHAUSTED."""
    message: str

    def __str__(self) -> str:
        where = f" on {self.executor}" if self.executor else ""
        sid = f" ({self.sandbox_id})" if self.sandbox_id else ""
        return f"child {self.index}{sid}{where}: {self.code}: {self.message}"


class SpawnError(TineError):
    """Some children of a spawn failed (or the spawn stream broke off part-way).

    ``failures`` lists the failed children; ``sandboxes`` holds the children that did
    become ready, which are still running: use or kill them.
    """

    def __init__(
        self,
        code: str,
        message: str,
        failures: list[SpawnFailure],
        sandboxes: list[Sandbox],
    ) -> None:
        super().__init__(code, message)
        self.failures = failures
        self.sandboxes = sandboxes


class EvalError(Exception):
    """The code given to ``Sandbox.eval`` raised inside the sandbox.

    ``traceback`` is the guest's traceback text; ``stdout``/``stderr`` what the code
    printed before it raised.
    """

    def __init__(self, traceback: str, stdout: str = "", stderr: str = "") -> None:
        super().__init__(traceback)
        self.traceback = traceback
        self.stdout = stdout
        self.stderr = stderr
