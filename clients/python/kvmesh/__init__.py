"""kvmesh: a Python client for kvmesh nodes (the ``kvmesh.v1.CacheService`` gRPC API).

    import kvmesh, numpy as np

    spec = kvmesh.CacheSpec(name="m", dtype=kvmesh.DType.F16, max_sequences=8, capacity=4096,
                            max_batch=256, groups=[kvmesh.Attention(32, 8, 128)])
    with kvmesh.Client("127.0.0.1:7700") as client:
        client.create_cache(spec)
        data = client.layout("m").zeros(tokens=16)      # [layers, tokens, heads, head_dim]
        client.append("m", kvmesh.tokens(0, range(16)), data)
        kv = client.read("m", seq=0).data[0]            # kvmesh.KV: kv.k, kv.v

Modules: :mod:`kvmesh.spec` (cache specs), :mod:`kvmesh.layout` (the payload layout),
:mod:`kvmesh.client` (the client), :mod:`kvmesh.errors` (exceptions per status code),
:mod:`kvmesh.results` (what calls return), :mod:`kvmesh.dtypes` (numpy types, bfloat16).
The gRPC stubs, ``kvmesh.v1``, are generated at build time (clients/python/README.md).
"""

# The generated stubs (kvmesh/v1/) live in the build tree, apart from these sources: let the
# package span every kvmesh/ directory on sys.path. An install puts both in one directory.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .dtypes import from_bfloat16, numpy_dtype, to_bfloat16  # noqa: E402
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,  # noqa: E402
                     FailedPrecondition, Internal, InvalidArgument, KvmeshError, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Shortage, Unauthenticated,
                     Unavailable, Unimplemented, Unknown, error_for_code)
from .layout import KV, GroupData, PayloadLayout, States, count_states  # noqa: E402
from .results import (CacheInfo, CacheUsage, CopiedPrefix, CreateResult,  # noqa: E402
                      DrainedSequence, DrainedSnapshot, DrainResult, DrainStayed, GroupSequence,
                      GroupUsage, Member, MemberHealth, MigratedSnapshot, NodeResult,
                      PrefixMatch, ReadResult, Event, EventBatch,
                      SequenceInfo, SnapshotGroup, SnapshotInfo, SplitResult, StateStatus,
                      TransferStats)
from .spec import (Attention, CacheSpec, ChunkedWindow, DType, FullWindow,  # noqa: E402
                   Group, Recurrent, Rope, RopeType, Rotating, SlidingWindow, Window)


def __getattr__(name: str) -> object:
    # The client needs the generated stubs; import it on first use, so that the spec and the
    # payload layout work (and can be tested) without them.
    if name in ("Client", "TlsOptions", "Token", "tokens"):
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module 'kvmesh' has no attribute {name!r}")


__all__ = [
    "Client", "TlsOptions", "Token", "tokens",
    "CacheSpec", "DType", "Attention", "Rotating", "Recurrent", "Group", "Rope", "RopeType",
    "FullWindow", "SlidingWindow", "ChunkedWindow", "Window",
    "PayloadLayout", "KV", "States", "GroupData", "count_states",
    "numpy_dtype", "to_bfloat16", "from_bfloat16",
    "KvmeshError", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
    "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted",
    "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated",
    "error_for_code", "Shortage",
    "StateStatus", "MemberHealth", "GroupUsage", "CacheUsage", "CacheInfo", "CreateResult",
    "GroupSequence", "SequenceInfo", "ReadResult", "SnapshotGroup", "SnapshotInfo",
    "SplitResult", "TransferStats", "CopiedPrefix", "MigratedSnapshot", "NodeResult", "Member",
    "PrefixMatch", "Event", "EventBatch",
    "DrainedSequence", "DrainedSnapshot", "DrainStayed", "DrainResult",
]
