"""Conversions between the generated proto messages and the client's Python types. The only
module besides client.py that touches the stubs."""

from __future__ import annotations

from typing import Dict, Optional

import grpc

from ._proto import pb
from .results import (CacheInfo, CacheUsage, DrainedSequence, DrainedSnapshot, DrainResult,
                      DrainStayed, GroupSequence, GroupUsage, Member, MemberHealth, NodeResult,
                      SequenceInfo, SnapshotGroup, SnapshotInfo, StateStatus, TransferStats)
from .spec import (Attention, CacheSpec, ChunkedWindow, DType, FullWindow, Group, Recurrent,
                   Rope, RopeType, Rotating, SlidingWindow, Window)

# google.rpc.Code numbers (NodeResult.code) -> grpc.StatusCode.
_STATUS_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


# ---- spec ----------------------------------------------------------------------------------

def _rope_to_proto(rope: Rope) -> "pb.Rope":
    return pb.Rope(type=int(rope.type), dims=rope.dims, base=rope.base,
                   freq_scale=rope.freq_scale)


def _window_to_proto(window: Window) -> "pb.Window":
    if isinstance(window, SlidingWindow):
        return pb.Window(sliding=pb.Window.Sliding(window=window.window, memory=window.memory))
    if isinstance(window, ChunkedWindow):
        return pb.Window(chunked=pb.Window.Chunked(chunk=window.chunk))
    if isinstance(window, FullWindow):
        return pb.Window(full=pb.Window.Full())
    raise TypeError(f"window is a {type(window).__name__}, not a FullWindow, SlidingWindow or "
                    "ChunkedWindow")


def _group_to_proto(group: Group) -> "pb.LayerGroup":
    if isinstance(group, Attention):
        return pb.LayerGroup(num_layers=group.num_layers, attention=pb.Attention(
            num_kv_heads=group.num_kv_heads, head_dim_k=group.head_dim_k,
            head_dim_v=group.head_dim_v, window=_window_to_proto(group.window),
            rope=_rope_to_proto(group.rope)))
    if isinstance(group, Rotating):
        return pb.LayerGroup(num_layers=group.num_layers, rotating=pb.Rotating(
            num_kv_heads=group.num_kv_heads, head_dim_k=group.head_dim_k,
            head_dim_v=group.head_dim_v, max_size=group.max_size,
            rope=_rope_to_proto(group.rope)))
    return pb.LayerGroup(num_layers=group.num_layers, recurrent=pb.Recurrent(
        conv_tail=group.conv_tail, conv_dim=group.conv_dim, num_v_heads=group.num_v_heads,
        head_v_dim=group.head_v_dim, head_k_dim=group.head_k_dim))


def spec_to_proto(spec: CacheSpec) -> "pb.CacheSpec":
    """The ``kvmesh.v1.CacheSpec`` of ``spec``."""
    return pb.CacheSpec(name=spec.name, dtype=int(spec.dtype), max_sequences=spec.max_sequences,
                        capacity=spec.capacity, max_batch=spec.max_batch,
                        groups=[_group_to_proto(g) for g in spec.groups],
                        token_block_size=spec.token_block_size,
                        eviction=(pb.EVICTION_POLICY_LRU if spec.eviction == "lru"
                                  else pb.EVICTION_POLICY_UNSPECIFIED))


def _rope_from_proto(rope: "pb.Rope") -> Rope:
    return Rope(RopeType(rope.type), rope.dims, rope.base, rope.freq_scale)


def _window_from_proto(window: "pb.Window") -> Window:
    kind = window.WhichOneof("kind")
    if kind == "sliding":
        return SlidingWindow(window.sliding.window, window.sliding.memory)
    if kind == "chunked":
        return ChunkedWindow(window.chunked.chunk)
    return FullWindow()


def _group_from_proto(group: "pb.LayerGroup") -> Group:
    kind = group.WhichOneof("kind")
    if kind == "attention":
        a = group.attention
        return Attention(group.num_layers, a.num_kv_heads, a.head_dim_k, a.head_dim_v,
                         _window_from_proto(a.window), _rope_from_proto(a.rope))
    if kind == "rotating":
        r = group.rotating
        return Rotating(group.num_layers, r.num_kv_heads, r.head_dim_k, r.max_size,
                        r.head_dim_v, _rope_from_proto(r.rope))
    if kind == "recurrent":
        c = group.recurrent
        return Recurrent(group.num_layers, c.conv_tail, c.conv_dim, c.num_v_heads, c.head_v_dim,
                         c.head_k_dim)
    raise ValueError(f"the node sent a layer group without a kind: {group}")


def spec_from_proto(spec: "pb.CacheSpec") -> CacheSpec:
    """The :class:`CacheSpec` of a ``kvmesh.v1.CacheSpec`` the node sent."""
    return CacheSpec(name=spec.name, dtype=DType(spec.dtype), max_sequences=spec.max_sequences,
                     capacity=spec.capacity, max_batch=spec.max_batch,
                     groups=tuple(_group_from_proto(g) for g in spec.groups),
                     token_block_size=spec.token_block_size,
                     eviction="lru" if spec.eviction == pb.EVICTION_POLICY_LRU else "none")


# ---- responses -----------------------------------------------------------------------------

def usage_from_proto(usage: "pb.CacheUsage") -> CacheUsage:
    return CacheUsage(
        groups=tuple(GroupUsage(g.group, g.cells_total, g.cells_used, g.memory, g.bytes,
                                g.cells_reserved)
                     for g in usage.groups),
        sequences_live=usage.sequences_live, bytes_held=usage.bytes_held,
        snapshots=usage.snapshots, snapshot_bytes=usage.snapshot_bytes,
        export_bytes=usage.export_bytes, sequences_reserved=usage.sequences_reserved)


def cache_info_from_proto(info: "pb.CacheInfo") -> CacheInfo:
    return CacheInfo(spec_from_proto(info.spec), usage_from_proto(info.usage), info.tenant)


def sequence_from_proto(info: "pb.SequenceInfo") -> SequenceInfo:
    return SequenceInfo(
        seq=info.seq, offset=info.offset, pending=info.pending,
        groups=tuple(GroupSequence(g.group, g.stored, g.shared, g.first, g.last,
                                   StateStatus(g.state)) for g in info.groups),
        tokens=info.tokens, exact_tokens=info.exact_tokens, token_blocks=info.token_blocks,
        priority=info.priority, pinned=info.pinned, ttl=info.ttl_ms / 1000.0,
        idle=info.idle_ms / 1000.0)


def snapshot_from_proto(info: "pb.SnapshotInfo") -> SnapshotInfo:
    return SnapshotInfo(
        id=info.id, seq=info.seq, from_offset=info.from_offset, to_offset=info.to_offset,
        bytes=info.bytes,
        groups=tuple(SnapshotGroup(g.group, g.stored, g.ring_index, StateStatus(g.state))
                     for g in info.groups),
        tokens=info.tokens)


def transfer_from_proto(message: object, field: str = "transfer") -> Optional[TransferStats]:
    """``message.<field>`` as TransferStats, or None when the field is unset."""
    if not message.HasField(field):  # type: ignore[attr-defined]
        return None
    t = getattr(message, field)
    return TransferStats(t.transport, t.bytes, t.micros)


def node_result_from_proto(result: "pb.NodeResult") -> NodeResult:
    return NodeResult(result.node, _STATUS_BY_NUMBER.get(result.code, grpc.StatusCode.UNKNOWN),
                      result.message)


def member_from_proto(m: "pb.Member") -> Member:
    return Member(name=m.name, address=m.address, is_self=getattr(m, "self"),
                  health=MemberHealth(m.health), backend=m.backend,
                  transports=tuple(m.transports), detail=m.detail, boot_id=m.boot_id,
                  start_time_unix_ms=m.start_time_unix_ms, version=m.version)


def drain_from_proto(r: "pb.DrainResponse") -> DrainResult:
    stayed = []
    for s in r.stayed:
        what = s.WhichOneof("what")
        stayed.append(DrainStayed(s.tenant, s.cache, s.seq if what == "seq" else None,
                                  s.snapshot_id if what == "snapshot_id" else None, s.reason))
    return DrainResult(
        sequences=tuple(DrainedSequence(s.tenant, s.cache, s.seq, s.node, s.target_seq,
                                        transfer_from_proto(s)) for s in r.sequences),
        snapshots=tuple(DrainedSnapshot(s.tenant, s.cache, s.snapshot_id, s.node,
                                        s.target_snapshot_id, transfer_from_proto(s))
                        for s in r.snapshots),
        stayed=tuple(stayed), draining=r.draining, caches_created=tuple(r.caches_created),
        micros=r.micros)
