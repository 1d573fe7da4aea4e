"""What the client's calls return: plain frozen dataclasses for the proto responses
(docs/api.md describes every field)."""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional, Tuple

import grpc

from .layout import GroupData
from .spec import CacheSpec

__all__ = [
    "StateStatus",
    "MemberHealth",
    "GroupUsage",
    "CacheUsage",
    "CacheInfo",
    "CreateResult",
    "GroupSequence",
    "SequenceInfo",
    "ReadResult",
    "SnapshotGroup",
    "SnapshotInfo",
    "SplitResult",
    "TransferStats",
    "MigratedSnapshot",
    "NodeResult",
    "Member",
    "DrainedSequence",
    "DrainedSnapshot",
    "DrainStayed",
    "DrainResult",
]


class StateStatus(enum.IntEnum):
    """A recurrent state's status. NONE: not Recurrent, no state, or a Read range that stops
    before the offset; INVALID: a Remove below the offset invalidated it (never served)."""

    NONE = 0
    VALID = 1
    INVALID = 2


class MemberHealth(enum.IntEnum):
    """A cluster member's health as the called node last saw it."""

    UNKNOWN = 0
    SERVING = 1
    NOT_SERVING = 2
    UNREACHABLE = 3


@dataclasses.dataclass(frozen=True)
class GroupUsage:
    """Storage of one group: cells (Attention), ring rows (Rotating) or state slots
    (Recurrent); ``memory`` is the effective tokens kept per sequence (0: unlimited)."""

    group: int
    cells_total: int
    cells_used: int
    memory: int
    bytes: int
    #: Of the free cells, those held back for room reservations (Client.reserve).
    cells_reserved: int = 0


@dataclasses.dataclass(frozen=True)
class CacheUsage:
    """A cache's usage (docs/api.md, "Capacity and budgets")."""

    groups: Tuple[GroupUsage, ...]
    sequences_live: int
    bytes_held: int
    snapshots: int
    snapshot_bytes: int
    export_bytes: int
    #: Sequences that store nothing yet but hold a room reservation.
    sequences_reserved: int = 0


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """A cache's spec as stored (windows explicit), its usage and its tenant."""

    spec: CacheSpec
    usage: CacheUsage
    tenant: str


@dataclasses.dataclass(frozen=True)
class CreateResult:
    """CreateCache's answer: ``created`` is False when an equal cache already existed."""

    cache: CacheInfo
    created: bool


@dataclasses.dataclass(frozen=True)
class GroupSequence:
    """One group's view of a sequence: positions ``stored`` (0 for Recurrent), cells
    ``shared`` with other sequences, ``first``/``last`` position (-1 when none) and the
    recurrent ``state``."""

    group: int
    stored: int
    shared: int
    first: int
    last: int
    state: StateStatus


@dataclasses.dataclass(frozen=True)
class SequenceInfo:
    """A live sequence: its offset (pending tokens included), pending speculative tokens, and
    per-group details."""

    seq: int
    offset: int
    pending: int
    groups: Tuple[GroupSequence, ...]
    #: Token ids known, for positions [0, tokens); of those, the first ``exact_tokens`` hold K/V
    #: computed from those tokens alone, in ``token_blocks`` hashed blocks (docs/api.md#tokens).
    tokens: int = 0
    exact_tokens: int = 0
    token_blocks: int = 0
    #: Retention (:meth:`Client.set_retention`): priority, pin, TTL in seconds (0: none), and
    #: seconds since the sequence was last used.
    priority: int = 0
    pinned: bool = False
    ttl: float = 0.0
    idle: float = 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class ReadResult:
    """A Read: per group the positions returned (ascending) and the recurrent state's status,
    the data decoded per group (:class:`kvmesh.KV` / :class:`kvmesh.States`, 1 state when
    VALID, else 0), and the raw payload bytes."""

    positions: Tuple[Tuple[int, ...], ...]
    states: Tuple[StateStatus, ...]
    data: List[GroupData]
    payload: bytes


@dataclasses.dataclass(frozen=True)
class SnapshotGroup:
    """One group of a snapshot: positions ``stored``, the ring index (Rotating; -1 otherwise)
    and the state (Recurrent: VALID)."""

    group: int
    stored: int
    ring_index: int
    state: StateStatus


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot of [from_offset, to_offset) of sequence ``seq``, ``bytes`` of pool data."""

    id: int
    seq: int
    from_offset: int
    to_offset: int
    bytes: int
    groups: Tuple[SnapshotGroup, ...]
    tokens: int = 0  #: token ids it keeps, of positions [0, tokens)


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """SplitSnapshot's answer; either part may be absent (None)."""

    parent: Optional[SnapshotInfo]
    child: Optional[SnapshotInfo]


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """How a payload moved between two nodes."""

    transport: str
    bytes: int
    micros: int

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9) per second; 0 for an instant transfer."""
        return self.bytes / (self.micros * 1e3) if self.micros > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class CopiedPrefix:
    """CopyPrefix's answer: dst's offset after the copy (0 when it got nothing) and, for a
    copy across nodes, how the payload moved (None for a local copy, which shares cells)."""

    offset: int
    transfer: Optional[TransferStats]
    #: Across nodes: the positions dst already held with the source's token ids and kept
    #: instead of receiving them (an incremental pull, docs/api.md#copyprefix).
    kept_positions: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """A sequence that holds a prefix of a prompt (lookup_prefix): the prompt's first
    ``length`` tokens; ``node`` holds it ("" without a cluster), ``offset`` is the
    sequence's, ``can_resume`` whether every group can continue at ``length``.
    ``verified``: compared token by token on ``node``; False for another member's sequence
    known by block hash only (a cluster lookup without ``verify``), whose ``length`` is whole
    blocks and ``can_resume`` unknown (False)."""

    node: str
    seq: int
    length: int
    offset: int
    can_resume: bool
    verified: bool = True


@dataclasses.dataclass(frozen=True)
class Event:
    """One change on a node (watch_events; docs/api.md#watchevents). ``kind`` is the name of
    ``kvmesh.v1.EventKind`` without its prefix ("BLOCKS", "REMOVED", ...); ``number`` is 0 for
    the entries of a listing; ``token_block_size`` is the cache's, on BLOCKS and
    CACHE_CREATED events."""

    number: int
    kind: str
    cache: str
    seq: int
    offset: int = 0
    kept_blocks: int = 0
    block_hashes: Tuple[int, ...] = ()
    begin: int = 0
    end: int = -1
    snapshot: int = 0
    peer: str = ""
    time_unix_micros: int = 0
    token_block_size: int = 0
    #: EVICTED: "lru" (room for an Append) or "ttl" (idle past its TTL).
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class EventBatch:
    """One message of a WatchEvents stream: its events, the node's ``boot_id``, ``next`` (where
    to resume) and whether it ends the listing (``synced``)."""

    boot_id: str
    next: int
    synced: bool
    events: Tuple[Event, ...]


@dataclasses.dataclass(frozen=True)
class MigratedSnapshot:
    """MigrateSnapshot's answer: the snapshot as stored on the target (its id there)."""

    snapshot: SnapshotInfo
    transfer: Optional[TransferStats]


@dataclasses.dataclass(frozen=True)
class NodeResult:
    """One member's outcome of a cluster-scope Remove."""

    node: str
    code: grpc.StatusCode
    message: str

    @property
    def ok(self) -> bool:
        """Whether the member's Remove succeeded."""
        return self.code == grpc.StatusCode.OK


@dataclasses.dataclass(frozen=True)
class Member:
    """A cluster member as the called node sees it. ``boot_id`` changes when the node
    restarts (it then holds nothing it held before); ``start_time_unix_ms`` is when that
    process started and ``version`` its build's version (empty/0 while never reached).
    Address, backend, transports and detail are empty for callers that are not admins."""

    name: str
    address: str
    is_self: bool
    health: MemberHealth
    backend: str
    transports: Tuple[str, ...]
    detail: str
    boot_id: str
    start_time_unix_ms: int
    version: str


@dataclasses.dataclass(frozen=True)
class DrainedSequence:
    """A sequence a drain moved: ``seq`` here is ``target_seq`` on ``node`` now."""

    tenant: str
    cache: str
    seq: int
    node: str
    target_seq: int
    transfer: Optional[TransferStats]


@dataclasses.dataclass(frozen=True)
class DrainedSnapshot:
    """A snapshot a drain moved: ``snapshot_id`` here is ``target_snapshot_id`` on ``node``."""

    tenant: str
    cache: str
    snapshot_id: int
    node: str
    target_snapshot_id: int
    transfer: Optional[TransferStats]


@dataclasses.dataclass(frozen=True)
class DrainStayed:
    """A sequence (``seq``) or snapshot (``snapshot_id``) still here after a drain, and why."""

    tenant: str
    cache: str
    seq: Optional[int]
    snapshot_id: Optional[int]
    reason: str


@dataclasses.dataclass(frozen=True)
class DrainResult:
    """Drain's answer: where everything went and what stayed."""

    sequences: Tuple[DrainedSequence, ...]
    snapshots: Tuple[DrainedSnapshot, ...]
    stayed: Tuple[DrainStayed, ...]
    draining: bool
    caches_created: Tuple[str, ...]
    micros: int
