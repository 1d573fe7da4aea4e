"""Exceptions of the kvmesh client.

Every failed RPC raises a subclass of :class:`KvmeshError`, one per gRPC status code, that keeps
the code and the node's message as it was sent (docs/api.md, "Error codes", says what each code
means for each call). Errors found before any RPC is made (an array of the wrong shape or dtype,
a malformed token) are plain :class:`ValueError` or :class:`TypeError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Optional, Tuple, Type

import grpc

try:  # generated at build time beside kvmesh.v1 (clients/python/CMakeLists.txt)
    from google.rpc import error_details_pb2 as _error_details_pb2
    from google.rpc import status_pb2 as _status_pb2
except ImportError:  # pragma: no cover - without them errors carry no shortage
    _error_details_pb2 = None
    _status_pb2 = None

# The ErrorInfo domain of kvmesh's structured details.
ERROR_DOMAIN = "kvmesh.io"

__all__ = [
    "KvmeshError",
    "Cancelled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "Shortage",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
    "error_for_code",
]


class KvmeshError(Exception):
    """A kvmesh RPC failed.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode``).
        message: the node's message, unchanged (it names the fields and values involved).
        method: the RPC that failed, e.g. ``"Append"``; empty when unknown.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None,
                 method: str = "") -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.method = method
        where = f" ({method})" if method else ""
        super().__init__(f"{self.code.name}: {message}{where}")

    @property
    def retryable(self) -> bool:
        """Whether retrying the same call may succeed (docs/api.md, "Error codes").

        UNAVAILABLE (a full queue, a peer down, a draining node) and ABORTED (pending tokens, a
        migration in progress) pass; DEADLINE_EXCEEDED and DATA_LOSS of cluster calls are safe
        to retry too, since nothing was committed.
        """
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS)


class Cancelled(KvmeshError):
    """CANCELLED: the call was cancelled, or its stream broke."""
    code = grpc.StatusCode.CANCELLED


class Unknown(KvmeshError):
    """UNKNOWN: an error gRPC could not classify."""
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KvmeshError):
    """INVALID_ARGUMENT: the request is malformed whatever the state (bad spec, payload size...)."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvmeshError):
    """DEADLINE_EXCEEDED: the call's deadline passed (or a cluster step's, or an idle stream's)."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KvmeshError):
    """NOT_FOUND: no such cache, snapshot, or a sequence that stores nothing."""
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvmeshError):
    """ALREADY_EXISTS: a cache of this name exists with another spec."""
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KvmeshError):
    """PERMISSION_DENIED: an admin-only call or metadata from a caller that is not an admin."""
    code = grpc.StatusCode.PERMISSION_DENIED


@dataclasses.dataclass(frozen=True)
class Shortage:
    """What ran short, in numbers (docs/api.md#error-details).

    Attributes:
        reason: "CELLS_EXHAUSTED", "RINGS_EXHAUSTED", "STATE_SLOTS_EXHAUSTED",
            "SEQUENCES_EXHAUSTED", "PENDING_TOKENS_EXHAUSTED", "DEVICE_MEMORY_EXHAUSTED",
            "SNAPSHOT_POOL_EXHAUSTED", "INFLIGHT_BUDGET_EXHAUSTED" or
            "METADATA_BUDGET_EXHAUSTED".
        group: the layer group's index, -1 when the resource is not a group's.
        needed: units the call needed; free: units free when it was refused; total: in all.
    """

    reason: str
    group: int
    needed: int
    free: int
    total: int


class ResourceExhausted(KvmeshError):
    """RESOURCE_EXHAUSTED: cells, sequences, budgets, quotas or message sizes ran out.

    ``shortage`` says what ran short in numbers when the node sent them, else None.
    """
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    shortage: Optional[Shortage] = None


class FailedPrecondition(KvmeshError):
    """FAILED_PRECONDITION: valid, but the current state cannot serve it; do not retry as is."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KvmeshError):
    """ABORTED: pending speculative tokens or a migration hold the sequence; retry later."""
    code = grpc.StatusCode.ABORTED


class OutOfRange(KvmeshError):
    """OUT_OF_RANGE (not used by kvmesh itself)."""
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KvmeshError):
    """UNIMPLEMENTED: the node does not know this RPC (an older node)."""
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvmeshError):
    """INTERNAL: a device (CUDA) error on the node."""
    code = grpc.StatusCode.INTERNAL


class Unavailable(KvmeshError):
    """UNAVAILABLE: the node or a peer is down, its queue is full, or it is draining."""
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KvmeshError):
    """DATA_LOSS: a transfer between nodes arrived corrupted; nothing was committed."""
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KvmeshError):
    """UNAUTHENTICATED: no bearer token, or one the node does not know."""
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[KvmeshError]] = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}


def error_for_code(code: grpc.StatusCode) -> Type[KvmeshError]:
    """The exception class of a gRPC status code (:class:`KvmeshError` itself for an odd one)."""
    return _BY_CODE.get(code, KvmeshError)


def shortage_from_trailers(trailers: Iterable[Tuple[str, Any]]) -> Optional[Shortage]:
    """The :class:`Shortage` in a failed call's ``grpc-status-details-bin`` trailer (a
    google.rpc.Status holding a google.rpc.ErrorInfo of domain "kvmesh.io"), or None."""
    if _status_pb2 is None or _error_details_pb2 is None:
        return None
    for key, value in trailers or ():
        if key != "grpc-status-details-bin":
            continue
        status = _status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # noqa: BLE001 - a malformed trailer carries no shortage
            return None
        for any_detail in status.details:
            info = _error_details_pb2.ErrorInfo()
            if not any_detail.Is(info.DESCRIPTOR) or not any_detail.Unpack(info):
                continue
            if info.domain != ERROR_DOMAIN:
                continue
            try:
                return Shortage(reason=info.reason,
                                group=int(info.metadata.get("group", "-1")),
                                needed=int(info.metadata["needed"]),
                                free=int(info.metadata["free"]),
                                total=int(info.metadata["total"]))
            except (KeyError, ValueError):
                continue
    return None


def from_rpc_error(error: grpc.RpcError, method: str) -> KvmeshError:
    """The :class:`KvmeshError` for a failed gRPC call of ``method``."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    exception = error_for_code(code)(details or "", code=code, method=method)
    if isinstance(exception, ResourceExhausted) and hasattr(error, "trailing_metadata"):
        exception.shortage = shortage_from_trailers(error.trailing_metadata())
    return exception
