"""The kvmesh client: one connection to one node's ``kvmesh.v1.CacheService``.

Every method makes one RPC (``append`` one Append or one AppendStream) with a deadline: the
method's ``timeout`` in seconds, or the client's default when it is None. A failed RPC raises
the :class:`kvmesh.KvmeshError` subclass of its status code; data that does not fit the payload
layout raises ValueError before any RPC. docs/api.md describes what every call does.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc

from . import _convert
from ._proto import pb, pb_grpc
from .errors import from_rpc_error
from .layout import GroupData, PayloadLayout, count_states
from .results import (CacheInfo, CacheUsage, CopiedPrefix, CreateResult, DrainResult, Member,
                      PrefixMatch, Event, EventBatch,
                      MigratedSnapshot, NodeResult, ReadResult, SequenceInfo, SnapshotInfo,
                      SplitResult, StateStatus, TransferStats)
from .spec import CacheSpec, Recurrent

__all__ = ["Client", "TlsOptions", "Token", "tokens"]

# The page size the List methods ask for unless told: the node's largest for sequences and
# snapshots; it takes more than its maximum for caches (1000) as that maximum
# (docs/api.md#paging).
_MAX_PAGE_SIZE = 4096


def _token_ranges(batch: List[Tuple[int, int]],
                  token_ids: Optional[Sequence[int]] = None) -> List["pb.TokenRange"]:
    """``batch`` in batch order as TokenRanges: one per run of consecutive positions of one
    sequence, so that a prompt chunk of 2,048 tokens is one range, not 2,048 Tokens. With
    ``token_ids`` (one per token), each range carries the ids of its positions."""
    ranges: List["pb.TokenRange"] = []
    for i, (seq, pos) in enumerate(batch):
        last = ranges[-1] if ranges else None
        if last is not None and last.seq == seq and last.first + last.count == pos:
            last.count += 1
        else:
            last = pb.TokenRange(seq=seq, first=pos, count=1)
            ranges.append(last)
        if token_ids is not None:
            last.token_ids.append(int(token_ids[i]))
    return ranges

Token = Tuple[int, int]
"""A token of an Append batch: (sequence id, position)."""

Data = Union[Sequence[GroupData], bytes, bytearray, memoryview]
"""An Append's data: one :class:`kvmesh.KV` / :class:`kvmesh.States` per group, or a payload
already encoded (its size is checked before the call)."""

_MiB = 1 << 20


def tokens(seq: int, positions: Union[range, Sequence[int]]) -> List[Token]:
    """The tokens of one sequence at ``positions``, e.g. ``tokens(7, range(0, 512))``."""
    return [(int(seq), int(p)) for p in positions]


def _ranges(positions: Sequence[int]) -> List[Tuple[int, int]]:
    """Ascending positions as maximal (first, last) ranges."""
    out: List[Tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] + 1 == p:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """TLS to a node started with ``--tls-cert`` (docs/security.md, "TLS and mTLS").

    Attributes:
        ca_file: PEM CA bundle that verifies the node's certificate; None: the system's roots.
        cert_file, key_file: the client certificate and key a node with ``--tls-client-ca``
            requires (both or neither).
        server_name: the name the node's certificate must carry, instead of the address's host.
    """

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    server_name: Optional[str] = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the files (read now)."""
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TlsOptions: cert_file and key_file go together")

        def read(path: Optional[str]) -> Optional[bytes]:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file),
                                            private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))


def _check_metadata_value(value: str, what: str) -> None:
    """gRPC metadata values are printable ASCII; a space would end a bearer token. The
    message never repeats a token."""
    if not value:
        raise ValueError(f"{what} is empty")
    for i, c in enumerate(value):
        if not 0x20 < ord(c) < 0x7F:
            raise ValueError(f"{what} has a space or a character outside printable ASCII "
                             f"(at offset {i})")


class Client:
    """A connection to one kvmesh node.

    Args:
        address: ``host:port`` of the node's ``--listen``.
        token: bearer token for a node with ``--token-file``, sent as ``authorization: Bearer
            <token>`` on every call.
        tenant: an admin acting for this tenant (``kvmesh-tenant`` metadata).
        tls: TLS settings; None: plaintext.
        timeout: default deadline of every call, in seconds (None: no deadline).
        stream_threshold: ``append`` sends payloads larger than this many bytes with
            AppendStream (keep it below the node's ``--max-message-bytes``, 128 MiB).
        chunk_bytes: AppendStream message size.
        channel_options: extra gRPC channel arguments.

    Thread-safe: gRPC channels are; the spec memo has a lock. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(self, address: str, *, token: Optional[str] = None,
                 tenant: Optional[str] = None, tls: Optional[TlsOptions] = None,
                 timeout: Optional[float] = 30.0, stream_threshold: int = 16 * _MiB,
                 chunk_bytes: int = _MiB,
                 channel_options: Sequence[Tuple[str, object]] = ()) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        metadata: List[Tuple[str, str]] = []
        if token is not None:
            _check_metadata_value(token, "the bearer token")
            metadata.append(("authorization", f"Bearer {token}"))
        if tenant is not None:
            _check_metadata_value(tenant, f"tenant {tenant[:32]!r}")
            metadata.append(("kvmesh-tenant", tenant))
        self.address = address
        self.timeout = timeout
        self.stream_threshold = stream_threshold
        self.chunk_bytes = chunk_bytes
        self._metadata = tuple(metadata)
        # The node enforces its own message limits; the client sets none.
        options: List[Tuple[str, object]] = [("grpc.max_receive_message_length", -1),
                                             ("grpc.max_send_message_length", -1)]
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            options.extend(channel_options)
            self._channel = grpc.secure_channel(address, tls.credentials(), options)
        else:
            options.extend(channel_options)
            self._channel = grpc.insecure_channel(address, options)
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._specs: dict = {}
        self._specs_lock = threading.Lock()

    # ---- connection ------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Waits until the channel is connected (raises grpc.FutureTimeoutError otherwise)."""
        grpc.channel_ready_future(self._channel).result(
            timeout=self.timeout if timeout is None else timeout)

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _call(self, method: str, request: object, timeout: Optional[float]) -> Any:
        """Calls the unary ``method`` with the deadline and metadata, mapping errors; returns
        its response message."""
        rpc: Callable[..., Any] = getattr(self._stub, method)
        try:
            return rpc(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error, method) from None

    def _pages(self, method: str, request: Any, page_size: Optional[int],
               timeout: Optional[float]) -> Iterator[Any]:
        """Calls the paged List ``method`` page after page until the node's last one
        (docs/api.md#paging), yielding each response; ``timeout`` applies to each call.
        ``page_size``: entries per call (None: the node's maximum)."""
        if page_size is not None:
            if page_size < 1:
                raise ValueError(f"page_size = {page_size} must be at least 1")
            request.page_size = page_size
        elif request.page_size == 0:
            # The node takes any size above its maximum as the maximum.
            request.page_size = _MAX_PAGE_SIZE
        while True:
            response = self._call(method, request, timeout)
            yield response
            if not response.next_page_token:
                return
            if response.next_page_token == request.page_token:
                raise RuntimeError(f"{method}: the node returned the page token it was given")
            request.page_token = response.next_page_token

    # ---- caches ----------------------------------------------------------------------------

    def create_cache(self, spec: CacheSpec, *, timeout: Optional[float] = None) -> CreateResult:
        """Creates a cache (idempotent for an equal spec: ``created`` is then False).
        INVALID_ARGUMENT names a bad field; ALREADY_EXISTS the first difference."""
        r = self._call("CreateCache", pb.CreateCacheRequest(spec=_convert.spec_to_proto(spec)),
                       timeout)
        info = _convert.cache_info_from_proto(r.cache)
        self._remember(info.spec)
        return CreateResult(info, r.created)

    def delete_cache(self, cache: str, *, timeout: Optional[float] = None) -> None:
        """Deletes a cache with its sequences and snapshots."""
        with self._specs_lock:
            self._specs.pop(cache, None)
        self._call("DeleteCache", pb.DeleteCacheRequest(cache=cache), timeout)

    def get_cache(self, cache: str, *, timeout: Optional[float] = None) -> CacheInfo:
        """A cache's spec and usage (and refreshes the spec this client remembers)."""
        info = _convert.cache_info_from_proto(
            self._call("GetCache", pb.GetCacheRequest(cache=cache), timeout).cache)
        self._remember(info.spec)
        return info

    def list_caches(self, *, page_size: Optional[int] = None,
                    timeout: Optional[float] = None) -> List[CacheInfo]:
        """Every cache of the caller's tenant (an admin without a tenant: every cache), by
        name (tenant, then name), fetched ``page_size`` at a time (None: the node's maximum)
        until the last page; ``timeout`` applies to each call."""
        return list(self.iter_caches(page_size=page_size, timeout=timeout))

    def iter_caches(self, *, page_size: Optional[int] = None,
                    timeout: Optional[float] = None) -> Iterator[CacheInfo]:
        """list_caches one page at a time: holds one page, fetches the next when needed."""
        for r in self._pages("ListCaches", pb.ListCachesRequest(), page_size, timeout):
            for c in r.caches:
                yield _convert.cache_info_from_proto(c)

    def layout(self, cache: str, *, timeout: Optional[float] = None) -> PayloadLayout:
        """The payload layout of ``cache``, from the spec this client saw for it in
        create_cache or get_cache (fetched with GetCache the first time)."""
        with self._specs_lock:
            spec = self._specs.get(cache)
        if spec is None:
            spec = self.get_cache(cache, timeout=timeout).spec
        return PayloadLayout(spec)

    def _remember(self, spec: CacheSpec) -> None:
        with self._specs_lock:
            self._specs[spec.name] = spec

    # ---- data ------------------------------------------------------------------------------

    def append(self, cache: str, batch: Sequence[Token], data: Data, *,
               token_ids: Optional[Sequence[int]] = None,
               speculative: bool = False, stream: Optional[bool] = None,
               chunk_bytes: Optional[int] = None,
               timeout: Optional[float] = None) -> CacheUsage:
        """Stores the K/V (and recurrent states) of ``batch``, (seq, pos) tokens in batch order.

        ``data`` holds one :class:`kvmesh.KV` per Attention/Rotating group (T = len(batch) rows)
        and one :class:`kvmesh.States` per Recurrent group (one state per distinct sequence in
        order of first appearance, or per token when ``speculative``); see
        :mod:`kvmesh.layout`. It is checked against the cache's layout before any RPC
        (ValueError). ``token_ids``: the token id of each token of ``batch`` (ValueError for
        another count), kept in the sequence's token chain (docs/api.md#tokens).
        ``speculative``: the tokens stay pending until commit_speculation.
        ``stream``: True sends AppendStream in ``chunk_bytes`` messages, False one Append,
        None decides by the payload's size (``stream_threshold``). Returns the usage after.
        """
        batch = [(int(s), int(p)) for s, p in batch]
        if token_ids is not None and len(token_ids) != len(batch):
            raise ValueError(f"token_ids has {len(token_ids)} ids for {len(batch)} tokens")
        layout = self.layout(cache, timeout=timeout)
        states = count_states(batch, speculative)
        if isinstance(data, (bytes, bytearray, memoryview)):
            payload = bytes(data)
            want = layout.payload_bytes(len(batch), states)
            if len(payload) != want:
                raise ValueError(f"the payload has {len(payload)} bytes; {len(batch)} tokens "
                                 f"with {states} recurrent state(s) need {want}")
        else:
            payload = layout.encode(data, len(batch), states)
        if stream is None:
            stream = len(payload) > self.stream_threshold
        ranges = _token_ranges(batch, token_ids)
        if not stream:
            r = self._call("Append", pb.AppendRequest(cache=cache, token_ranges=ranges,
                                                      payload=payload,
                                                      speculative=speculative), timeout)
            return _convert.usage_from_proto(r.usage)
        chunk = chunk_bytes or self.chunk_bytes
        if chunk <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk}")

        def messages() -> Iterator["pb.AppendStreamRequest"]:
            view = memoryview(payload)
            yield pb.AppendStreamRequest(
                header=pb.AppendHeader(cache=cache, token_ranges=ranges,
                                       payload_bytes=len(payload), speculative=speculative),
                data=bytes(view[:chunk]))
            for begin in range(chunk, len(payload), chunk):
                yield pb.AppendStreamRequest(data=bytes(view[begin:begin + chunk]))

        try:
            r = self._stub.AppendStream(messages(), timeout=self._deadline(timeout),
                                        metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error, "AppendStream") from None
        return _convert.usage_from_proto(r.usage)

    def read(self, cache: str, seq: int, begin: int = 0, end: Optional[int] = None, *,
             max_chunk_bytes: int = 0, timeout: Optional[float] = None) -> ReadResult:
        """The stored positions of ``seq`` in [begin, end) (end None: to the end) per group,
        with their K/V, and the recurrent states when the range reaches the offset.
        NOT_FOUND when the sequence stores nothing."""
        layout = self.layout(cache, timeout=timeout)
        request = pb.ReadRequest(cache=cache, seq=seq, begin=begin,
                                 max_chunk_bytes=max_chunk_bytes)
        if end is not None:
            request.end = end
        header = None
        chunks: List[bytes] = []
        try:
            for message in self._stub.Read(request, timeout=self._deadline(timeout),
                                           metadata=self._metadata):
                if message.HasField("header"):
                    header = message.header
                chunks.append(message.data)
        except grpc.RpcError as error:
            raise from_rpc_error(error, "Read") from None
        if header is None:
            raise ValueError("the node's Read stream had no header")
        payload = b"".join(chunks)
        if len(payload) != header.payload_bytes:
            raise ValueError(f"the node's Read stream carried {len(payload)} bytes, its header "
                             f"said {header.payload_bytes}")
        positions = tuple(tuple(g.positions) for g in header.groups)
        states = tuple(StateStatus(g.state) for g in header.groups)
        if len(positions) != len(layout.spec.groups):
            raise ValueError(f"the node's Read header lists {len(positions)} groups; the spec "
                             f"this client knows for {cache!r} has {len(layout.spec.groups)} "
                             "(get_cache refreshes it)")
        state_counts = [1 if isinstance(g, Recurrent) and s == StateStatus.VALID else 0
                        for g, s in zip(layout.spec.groups, states)]
        data = layout.decode(payload, [len(p) for p in positions], state_counts)
        return ReadResult(positions, states, data, payload)

    def visible(self, cache: str, group: int, queries: Sequence[Tuple[int, int]], *,
                non_causal: bool = False,
                timeout: Optional[float] = None) -> List[List[int]]:
        """Per (seq, pos) query, the stored positions it attends to in ``group`` (an Attention
        or Rotating group); ``non_causal`` drops the upper bound for every query."""
        r = self._call("Visible", self._visible_request(cache, group, queries, non_causal,
                                                         as_ranges=False), timeout)
        return [list(v.positions) for v in r.visible]

    def visible_ranges(self, cache: str, group: int, queries: Sequence[Tuple[int, int]], *,
                       non_causal: bool = False,
                       timeout: Optional[float] = None) -> List[List[Tuple[int, int]]]:
        """The same answer as ``visible``, as maximal (first, last) ranges of consecutive
        positions, both included: a sequence stored without gaps is one range."""
        r = self._call("Visible", self._visible_request(cache, group, queries, non_causal,
                                                         as_ranges=True), timeout)
        # A node older than as_ranges answers in positions.
        return [[(x.first, x.last) for x in v.ranges] if v.ranges else _ranges(v.positions)
                for v in r.visible]

    @staticmethod
    def _visible_request(cache: str, group: int, queries: Sequence[Tuple[int, int]],
                         non_causal: bool, as_ranges: bool) -> "pb.VisibleRequest":
        return pb.VisibleRequest(
            cache=cache, group=group, as_ranges=as_ranges,
            queries=[pb.Query(seq=s, pos=p, non_causal=non_causal) for s, p in queries])

    # ---- sequences -------------------------------------------------------------------------

    def copy_prefix(self, cache: str, src_seq: int, dst_seq: int, length: int, *,
                    source_node: str = "", require_src_offset: int = 0,
                    timeout: Optional[float] = None) -> CopiedPrefix:
        """Forks ``src_seq``'s positions below ``length`` into ``dst_seq`` (its old contents
        go). With ``source_node`` naming another member, this node pulls them from there (the
        result's ``transfer``; None for a local copy, which shares cells). With
        ``require_src_offset`` > 0, FailedPrecondition (nothing changes) unless src's offset is
        at least that: pass the offset your index recorded, so that a src removed or truncated
        since cannot empty dst. The result's ``offset`` is dst's offset after the copy."""
        r = self._call("CopyPrefix", pb.CopyPrefixRequest(
            cache=cache, src_seq=src_seq, dst_seq=dst_seq, length=length,
            source_node=source_node, require_src_offset=require_src_offset), timeout)
        return CopiedPrefix(r.offset, _convert.transfer_from_proto(r), r.kept_positions)

    def remove(self, cache: str, seq: int, begin: int, end: Optional[int] = None, *,
               cluster: bool = False, timeout: Optional[float] = None) -> List[NodeResult]:
        """Removes [begin, end) from ``seq``; positions at or past ``end`` move down by
        ``end - begin`` with their keys re-rotated (a context shift). ``end`` None truncates
        from ``begin``; ``begin = 0`` with no end drops the sequence. ``cluster``: on every
        member, returning each member's result (check them all); else an empty list."""
        request = pb.RemoveRequest(cache=cache, seq=seq, begin=begin,
                                   scope=pb.REMOVE_SCOPE_CLUSTER if cluster
                                   else pb.REMOVE_SCOPE_LOCAL)
        if end is not None:
            request.end = end
        r = self._call("Remove", request, timeout)
        return [_convert.node_result_from_proto(n) for n in r.nodes]

    def can_resume(self, cache: str, seq: int, pos: int, *,
                   timeout: Optional[float] = None) -> bool:
        """Whether a forward pass can continue ``seq`` at ``pos`` with what is stored."""
        return self._call("CanResume", pb.CanResumeRequest(cache=cache, seq=seq, pos=pos),
                          timeout).can_resume

    def reserve(self, cache: str, seq: int, positions: int, *, ttl: Optional[float] = None,
                timeout: Optional[float] = None) -> CacheUsage:
        """Sets aside room for ``seq`` to hold ``positions`` positions (what it stores counts)
        for ``ttl`` seconds (None: the node's 60 s; at most 3600): a sequence slot when it
        stores nothing, and the cells the positions still need. Other sequences cannot take it
        meanwhile, so a long prompt sent in pieces cannot be starved half-way. ``positions``
        0 drops the reservation. ResourceExhausted (with ``shortage``) when the room is not
        free now. Returns the usage after (``cells_reserved``, ``sequences_reserved``)."""
        ttl_ms = 0 if ttl is None else int(round(ttl * 1000))
        if ttl is not None and ttl_ms <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        r = self._call("Reserve", pb.ReserveRequest(cache=cache, seq=seq, positions=positions,
                                                    ttl_ms=ttl_ms), timeout)
        return _convert.usage_from_proto(r.usage)

    def set_retention(self, cache: str, seq: int, *, priority: int = 0, pinned: bool = False,
                      ttl: Optional[float] = None,
                      timeout: Optional[float] = None) -> SequenceInfo:
        """How long the live sequence ``seq`` is kept (docs/api.md#eviction): under the LRU
        eviction policy lower ``priority`` goes first and ``pinned`` never (to make room);
        ``ttl`` seconds: removed once unused that long (None: no TTL). Each call sets all
        three. NotFound when ``seq`` stores nothing. Returns the sequence after the call."""
        ttl_ms = 0 if ttl is None else int(round(ttl * 1000))
        if ttl is not None and ttl_ms <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        r = self._call("SetRetention", pb.SetRetentionRequest(
            cache=cache, seq=seq, priority=priority, pinned=pinned, ttl_ms=ttl_ms), timeout)
        return _convert.sequence_from_proto(r.sequence)

    def list_sequences(self, cache: str, *, page_size: Optional[int] = None,
                       timeout: Optional[float] = None) -> List[SequenceInfo]:
        """The live sequences of ``cache``, ascending by id, fetched ``page_size`` at a time
        (None: the node's maximum) until the last page; ``timeout`` applies to each call."""
        return list(self.iter_sequences(cache, page_size=page_size, timeout=timeout))

    def iter_sequences(self, cache: str, *, page_size: Optional[int] = None,
                       timeout: Optional[float] = None) -> Iterator[SequenceInfo]:
        """list_sequences one page at a time: holds one page, fetches the next when needed.
        Sequences created or removed meanwhile may or may not be seen; none is seen twice."""
        request = pb.ListSequencesRequest(cache=cache)
        for r in self._pages("ListSequences", request, page_size, timeout):
            for s in r.sequences:
                yield _convert.sequence_from_proto(s)

    def lookup_prefix(self, cache: str, tokens: Sequence[int], *, max_matches: int = 1,
                      cluster: bool = False, verify: bool = False,
                      timeout: Optional[float] = None) -> List[PrefixMatch]:
        """The sequences that hold the longest prefixes of the prompt ``tokens`` (token ids),
        longest first, at most ``max_matches``. ``cluster``: the other members' too, from this
        node's index of the cluster, by block hash unless ``verify`` asks their holders to
        compare token by token (docs/api.md#lookupprefix). Members that could not verify are
        left out."""
        scope = pb.LOOKUP_SCOPE_CLUSTER if cluster else pb.LOOKUP_SCOPE_LOCAL
        r = self._call("LookupPrefix",
                       pb.LookupPrefixRequest(cache=cache, tokens=[int(t) for t in tokens],
                                              max_matches=max_matches, scope=scope,
                                              verify=verify), timeout)
        return [PrefixMatch(m.node, m.seq, m.length, m.offset, m.can_resume, m.verified)
                for m in r.matches]

    def watch_events(self, caches: Sequence[str] = (), *, boot_id: str = "", next: int = 0,
                     timeout: Optional[float] = None) -> Iterator[EventBatch]:
        """What changes on the node (docs/api.md#watchevents), as the messages of a
        WatchEvents stream: a listing first (ending with ``synced``), unless ``boot_id`` and
        ``next`` resume an earlier stream. ``caches``: those to watch (all: empty). The
        stream's errors (RESOURCE_EXHAUSTED for a watcher that fell behind,
        FAILED_PRECONDITION after a restart, ...) are raised as :class:`kvmesh.KvmeshError`s while iterating."""
        request = pb.WatchEventsRequest(caches=list(caches), boot_id=boot_id, next=next)
        stream = self._stub.WatchEvents(request, timeout=self._deadline(timeout),
                                        metadata=self._metadata)
        try:
            for m in stream:
                yield EventBatch(m.boot_id, m.next, m.synced, tuple(
                    Event(e.number, pb.EventKind.Name(e.kind)[len("EVENT_KIND_"):], e.cache,
                          e.seq, e.offset, e.kept_blocks, tuple(e.block_hashes), e.begin,
                          e.end, e.snapshot, e.peer, e.time_unix_micros, e.token_block_size,
                          e.reason)
                    for e in m.events))
        except grpc.RpcError as error:
            raise from_rpc_error(error, "WatchEvents") from None
        finally:
            stream.cancel()

    # ---- snapshots and speculation ---------------------------------------------------------

    def snapshot(self, cache: str, seq: int, from_offset: int = 0, *,
                 timeout: Optional[float] = None) -> SnapshotInfo:
        """Copies [from_offset, offset) of ``seq`` into the snapshot pool."""
        r = self._call("Snapshot", pb.SnapshotRequest(cache=cache, seq=seq,
                                                      from_offset=from_offset), timeout)
        return _convert.snapshot_from_proto(r.snapshot)

    def restore(self, cache: str, seq: int, target: int, snapshot_id: Optional[int] = None, *,
                timeout: Optional[float] = None) -> None:
        """Rewinds ``seq`` to offset ``target``: on its own data, or from ``snapshot_id``
        (into any sequence: a fork from a checkpoint; the snapshot stays)."""
        request = pb.RestoreRequest(cache=cache, seq=seq, target=target)
        if snapshot_id is not None:
            request.snapshot_id = snapshot_id
        self._call("Restore", request, timeout)

    def merge_snapshots(self, cache: str, parent: int, child: int, *,
                        timeout: Optional[float] = None) -> SnapshotInfo:
        """[a, b) + [b, c) -> [a, c) under a new id; both inputs are consumed."""
        r = self._call("MergeSnapshots", pb.MergeSnapshotsRequest(cache=cache, parent=parent,
                                                                  child=child), timeout)
        return _convert.snapshot_from_proto(r.snapshot)

    def split_snapshot(self, cache: str, snapshot_id: int, at: int, *,
                       timeout: Optional[float] = None) -> SplitResult:
        """[a, c) -> [a, at) + [at, c) under new ids; the input is consumed."""
        r = self._call("SplitSnapshot", pb.SplitSnapshotRequest(
            cache=cache, snapshot_id=snapshot_id, at=at), timeout)
        return SplitResult(
            _convert.snapshot_from_proto(r.parent) if r.HasField("parent") else None,
            _convert.snapshot_from_proto(r.child) if r.HasField("child") else None)

    def drop_snapshot(self, cache: str, snapshot_id: int, *,
                      timeout: Optional[float] = None) -> None:
        """Deletes a snapshot."""
        self._call("DropSnapshot", pb.DropSnapshotRequest(cache=cache, snapshot_id=snapshot_id),
                   timeout)

    def list_snapshots(self, cache: str, *, page_size: Optional[int] = None,
                       timeout: Optional[float] = None) -> List[SnapshotInfo]:
        """The snapshots of ``cache``, ascending by id, fetched ``page_size`` at a time (None:
        the node's maximum) until the last page; ``timeout`` applies to each call."""
        return list(self.iter_snapshots(cache, page_size=page_size, timeout=timeout))

    def iter_snapshots(self, cache: str, *, page_size: Optional[int] = None,
                       timeout: Optional[float] = None) -> Iterator[SnapshotInfo]:
        """list_snapshots one page at a time."""
        request = pb.ListSnapshotsRequest(cache=cache)
        for r in self._pages("ListSnapshots", request, page_size, timeout):
            for s in r.snapshots:
                yield _convert.snapshot_from_proto(s)

    def commit_speculation(self, cache: str, seq: int, accepted: int, *,
                           timeout: Optional[float] = None) -> int:
        """Keeps the first ``accepted`` pending tokens of ``seq``, drops the rest; returns the
        sequence's offset afterwards."""
        return self._call("CommitSpeculation", pb.CommitSpeculationRequest(
            cache=cache, seq=seq, accepted=accepted), timeout).offset

    # ---- cluster ---------------------------------------------------------------------------

    def migrate(self, cache: str, seq: int, target_node: str, target_seq: Optional[int] = None,
                *, keep_source: bool = False,
                timeout: Optional[float] = None) -> Optional[TransferStats]:
        """Moves ``seq`` of this node to ``target_node`` as ``target_seq`` (default: the same
        id), replacing what it held there; removed here once the target has committed, unless
        ``keep_source``."""
        r = self._call("Migrate", pb.MigrateRequest(
            cache=cache, seq=seq, target_node=target_node,
            target_seq=seq if target_seq is None else target_seq, keep_source=keep_source),
            timeout)
        return _convert.transfer_from_proto(r)

    def migrate_snapshot(self, cache: str, snapshot_id: int, target_node: str, *,
                         keep_source: bool = False,
                         timeout: Optional[float] = None) -> MigratedSnapshot:
        """Copies a snapshot to ``target_node`` (a new id there), dropped here unless
        ``keep_source``."""
        r = self._call("MigrateSnapshot", pb.MigrateSnapshotRequest(
            cache=cache, snapshot_id=snapshot_id, target_node=target_node,
            keep_source=keep_source), timeout)
        return MigratedSnapshot(_convert.snapshot_from_proto(r.snapshot),
                                _convert.transfer_from_proto(r))

    def list_members(self, *, timeout: Optional[float] = None) -> List[Member]:
        """The cluster as this node sees it: itself first, then its peers by name."""
        r = self._call("ListMembers", pb.ListMembersRequest(), timeout)
        return [_convert.member_from_proto(m) for m in r.members]

    def drain(self, timeout_ms: int = 0, *, resume: bool = False,
              timeout: Optional[float] = None) -> DrainResult:
        """Admin: moves every sequence and snapshot of this node to its peers and stops taking
        new work (``timeout_ms`` 0: the node's ``--drain-timeout-ms``); ``resume`` ends
        draining. The node stops moving data a margin before this call's deadline, so give a
        ``timeout`` above ``timeout_ms`` (by default it is ``timeout_ms`` + 10 s when set)."""
        if timeout is None and timeout_ms > 0:
            timeout = timeout_ms / 1000.0 + 10.0
        r = self._call("Drain", pb.DrainRequest(timeout_ms=timeout_ms, resume=resume), timeout)
        return _convert.drain_from_proto(r)
