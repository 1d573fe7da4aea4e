"""The Python client against one real kvmesh-node: every call on the happy path, the errors
each status code becomes, and byte-exact round trips of Append and Read for Attention (F32, F16,
BF16), Rotating, Recurrent and hybrid caches, cross-checked with kvmeshctl's own payload
layout (service/ctl/payload.cc)."""

from __future__ import annotations

import itertools
import os
import tempfile
import unittest
from typing import List, Sequence

import grpc
import numpy as np

import kvmesh
from kvmesh import (KV, Attention, CacheSpec, ChunkedWindow, DType, Recurrent, Rope, Rotating,
                    SlidingWindow, StateStatus, States)

import nodes

RNG = np.random.default_rng(20261124)


def random_data(layout: kvmesh.PayloadLayout, tokens: int, states: int) -> List[kvmesh.GroupData]:
    """Data of the layout's shapes filled with random bits (any bit pattern is a valid
    payload: kvmesh stores bytes), except float32 delta states, which get random floats."""
    data = layout.zeros(tokens, states)
    for item in data:
        for array in ([item.k, item.v] if isinstance(item, KV) else [item.conv, item.delta]):
            if array is None:
                continue
            if array.dtype.kind == "f" and array.dtype.itemsize == 4:
                array[...] = RNG.standard_normal(array.shape, np.float32)
            else:
                array.view(f"u{array.dtype.itemsize}")[...] = RNG.integers(
                    0, 1 << (8 * array.dtype.itemsize), array.shape)
    return data


def rows(data: List[kvmesh.GroupData], index: Sequence[int],
         states: Sequence[int] = ()) -> List[kvmesh.GroupData]:
    """The tokens ``index`` (rows of K/V) and the states ``states`` of ``data``."""
    out: List[kvmesh.GroupData] = []
    for item in data:
        if isinstance(item, KV):
            out.append(KV(item.k[:, list(index)], item.v[:, list(index)]))
        else:
            out.append(States(item.conv[:, list(states)],
                              None if item.delta is None else item.delta[:, list(states)]))
    return out


class ClientTest(nodes.NodeTestCase):
    """One node for the whole class; each test works on caches of its own."""

    node: nodes.Node
    client: kvmesh.Client

    @classmethod
    def setUpClass(cls) -> None:
        cls.node = nodes.Node("py-single")
        cls.client = kvmesh.Client(cls.node.address, timeout=30)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.node.stop_checked()

    def create(self, spec: CacheSpec) -> kvmesh.PayloadLayout:
        self.assertTrue(self.client.create_cache(spec).created)
        self.addCleanup(self.client.delete_cache, spec.name)
        return self.client.layout(spec.name)

    def assert_data_equal(self, got: List[kvmesh.GroupData],
                          want: List[kvmesh.GroupData]) -> None:
        self.assertEqual(len(got), len(want))
        for g, (a, b) in enumerate(zip(got, want)):
            self.assertIs(type(a), type(b), f"group {g}")
            if isinstance(a, KV):
                np.testing.assert_array_equal(a.k, b.k, f"group {g} K")
                np.testing.assert_array_equal(a.v, b.v, f"group {g} V")
                self.assertEqual(a.k.dtype, b.k.dtype)
            else:
                np.testing.assert_array_equal(a.conv, b.conv, f"group {g} conv")
                self.assertEqual(a.delta is None, b.delta is None)
                if a.delta is not None:
                    np.testing.assert_array_equal(a.delta, b.delta, f"group {g} delta")

    # ---- caches -----------------------------------------------------------------------------

    def test_cache_lifecycle(self) -> None:
        spec = CacheSpec("py-life", DType.F16, max_sequences=4, capacity=64, max_batch=16,
                         groups=[Attention(2, 2, 8, window=SlidingWindow(8)),
                                 Attention(1, 1, 4, window=ChunkedWindow(16),
                                           rope=Rope.neox(4, 10000.0))])
        created = self.client.create_cache(spec)
        self.addCleanup(self.client.delete_cache, spec.name)
        self.assertTrue(created.created)
        self.assertEqual(created.cache.tenant, "default")
        # The spec comes back as sent (the client always sends the window); the usage reports
        # the effective sliding memory: 0 means window, raised to window + 1 (max_sequences > 1).
        self.assertEqual(created.cache.spec, spec)
        self.assertEqual(created.cache.usage.groups[0].memory, 9)
        self.assertEqual(created.cache.usage.sequences_live, 0)
        again = self.client.create_cache(spec)
        self.assertFalse(again.created)
        self.assertIn("py-life", [c.spec.name for c in self.client.list_caches()])
        self.assertEqual(self.client.get_cache("py-life").spec, spec)
        other = CacheSpec("py-life", DType.F32, 4, 64, 16, spec.groups)
        with self.assertRaises(kvmesh.AlreadyExists) as e:
            self.client.create_cache(other)
        self.assertIn("dtype", e.exception.message)

    def test_bad_spec_is_invalid_argument_with_the_message(self) -> None:
        spec = CacheSpec("py-bad", DType.F16, max_sequences=0, capacity=64, max_batch=16,
                         groups=[Attention(1, 1, 8)])
        with self.assertRaises(kvmesh.InvalidArgument) as e:
            self.client.create_cache(spec)
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("max_sequences", e.exception.message)
        self.assertEqual(e.exception.method, "CreateCache")
        self.assertIsInstance(e.exception, kvmesh.KvmeshError)
        self.assertTrue(str(e.exception).startswith("INVALID_ARGUMENT: "))
        rope = CacheSpec("py-bad", DType.F16, 1, 64, 16, [Attention(1, 1, 8, rope=Rope.normal(3))])
        with self.assertRaisesRegex(kvmesh.InvalidArgument, "dims"):
            self.client.create_cache(rope)

    def test_unknown_cache_is_not_found(self) -> None:
        for call in (lambda: self.client.get_cache("py-nope"),
                     lambda: self.client.list_sequences("py-nope"),
                     lambda: self.client.delete_cache("py-nope"),
                     lambda: self.client.append("py-nope", [(0, 0)], b"")):
            with self.assertRaises(kvmesh.NotFound) as e:
                call()
            self.assertIn("py-nope", e.exception.message)
            self.assertFalse(e.exception.retryable)

    def test_deadline(self) -> None:
        self.client.list_caches()  # connected
        self.node.freeze()
        try:
            with self.assertRaises(kvmesh.DeadlineExceeded) as e:
                self.client.list_caches(timeout=0.3)
        finally:
            self.node.thaw()
        self.assertTrue(e.exception.retryable)
        # The client's default applies when a call names none.
        slow = kvmesh.Client(self.node.address, timeout=0.3)
        self.addCleanup(slow.close)
        slow.list_caches(timeout=30)  # connected, whatever the machine's load
        self.node.freeze()
        try:
            with self.assertRaises(kvmesh.DeadlineExceeded):
                slow.list_caches()
        finally:
            self.node.thaw()

    # ---- data ------------------------------------------------------------------------------

    def test_attention_round_trip_every_dtype(self) -> None:
        for dtype in DType:
            with self.subTest(dtype=dtype.name):
                spec = CacheSpec(f"py-rt-{dtype.name}", dtype, 4, 64, 32,
                                 [Attention(3, 2, 8, head_dim_v=4), Attention(1, 4, 2)])
                layout = self.create(spec)
                # Two sequences interleaved in one batch, positions out of order.
                batch = [(5, 3), (2, 0), (5, 4), (2, 1), (5, 10), (2, 2)]
                data = random_data(layout, len(batch), 0)
                self.client.append(spec.name, batch, data)
                for seq in (5, 2):
                    index = [i for i, (s, _) in enumerate(batch) if s == seq]
                    result = self.client.read(spec.name, seq)
                    want_positions = tuple(sorted(batch[i][1] for i in index))
                    self.assertEqual(result.positions, (want_positions, want_positions))
                    order = sorted(index, key=lambda i: batch[i][1])
                    self.assert_data_equal(result.data, rows(data, order))
                    self.assertEqual(result.payload, layout.encode(result.data, len(index), 0))
                # A sub-range.
                result = self.client.read(spec.name, 5, begin=4, end=10)
                self.assertEqual(result.positions, ((4,), (4,)))
                self.assert_data_equal(result.data, rows(data, [2]))

    def test_bf16_values(self) -> None:
        spec = CacheSpec("py-bf16", DType.BF16, 1, 16, 8, [Attention(1, 1, 4)])
        layout = self.create(spec)
        values = np.array([[[[1.0, -0.5, 3.0, 0.15625]]]], np.float32)
        bits = kvmesh.to_bfloat16(values)
        self.client.append(spec.name, [(0, 0)], [KV(bits, bits)])
        got = self.client.read(spec.name, 0).data[0]
        self.assertEqual(got.k.dtype, np.dtype(np.uint16))
        np.testing.assert_array_equal(kvmesh.from_bfloat16(got.k), values)
        self.assertEqual(layout.dtype, np.dtype("<u2"))

    def test_shape_mismatch_is_rejected_before_any_rpc(self) -> None:
        spec = CacheSpec("py-shape", DType.F16, 2, 64, 16, [Attention(2, 2, 8)])
        layout = self.create(spec)
        data = layout.zeros(3)
        with self.assertRaisesRegex(ValueError, r"k has shape \(2, 3, 2, 8\); the layout "
                                    r"needs \(2, 4, 2, 8\)"):
            self.client.append(spec.name, kvmesh.tokens(0, range(4)), data)
        with self.assertRaisesRegex(ValueError, "the payload has 5 bytes"):
            self.client.append(spec.name, [(0, 0)], b"12345")
        with self.assertRaisesRegex(ValueError, "float16"):
            self.client.append(spec.name, [(0, 0)],
                               [KV(np.zeros((2, 1, 2, 8)), np.zeros((2, 1, 2, 8)))])
        self.assertEqual(self.client.list_sequences(spec.name), [])

    def test_append_stream(self) -> None:
        spec = CacheSpec("py-stream", DType.F32, 2, 256, 128, [Attention(4, 2, 16)])
        layout = self.create(spec)
        data = random_data(layout, 100, 0)
        batch = kvmesh.tokens(1, range(100))
        # Forced, in small messages; and chosen by size.
        self.client.append(spec.name, batch, data, stream=True, chunk_bytes=3000)
        self.assert_data_equal(self.client.read(spec.name, 1, max_chunk_bytes=4096).data, data)
        small = kvmesh.Client(self.node.address, stream_threshold=1024)
        self.addCleanup(small.close)
        usage = small.append(spec.name, kvmesh.tokens(2, range(100)), data)
        self.assertEqual(usage.sequences_live, 2)
        self.assert_data_equal(self.client.read(spec.name, 2).data, data)
        # A stream refused by the node keeps the status and message.
        with self.assertRaisesRegex(kvmesh.InvalidArgument, "already") as e:
            self.client.append(spec.name, batch[:1], rows(data, [0]), stream=True)
        self.assertEqual(e.exception.method, "AppendStream")

    def test_listings_follow_every_page(self) -> None:
        spec = CacheSpec("py-pages", DType.F16, 8, 4, 8, [Attention(1, 1, 4)])
        layout = self.create(spec)
        seqs = [9, 2, 7, 0, 5]
        self.client.append(spec.name, [(s, 0) for s in seqs], random_data(layout, len(seqs), 0))
        # The node answers a page of two and where the next starts; the client follows them.
        from kvmesh._proto import pb
        first = self.client._call(
            "ListSequences", pb.ListSequencesRequest(cache=spec.name, page_size=2), None)
        self.assertEqual([s.seq for s in first.sequences], [0, 2])
        self.assertNotEqual(first.next_page_token, "")
        for page_size in (1, 2, None):
            self.assertEqual([s.seq for s in self.client.list_sequences(
                spec.name, page_size=page_size)], [0, 2, 5, 7, 9])
        self.assertEqual([s.seq for s in self.client.iter_sequences(spec.name, page_size=2)],
                         [0, 2, 5, 7, 9])
        ids = [self.client.snapshot(spec.name, s).id for s in seqs]
        self.assertEqual([s.id for s in self.client.list_snapshots(spec.name, page_size=2)],
                         sorted(ids))
        self.assertIn(spec.name, [c.spec.name for c in self.client.list_caches(page_size=1)])
        with self.assertRaisesRegex(ValueError, "page_size = 0"):
            self.client.list_sequences(spec.name, page_size=0)

    def test_rotating_keeps_the_last_max_size(self) -> None:
        spec = CacheSpec("py-rot", DType.F16, 2, 32, 16, [Rotating(2, 1, 4, max_size=4)])
        layout = self.create(spec)
        data = random_data(layout, 6, 0)
        self.client.append(spec.name, kvmesh.tokens(0, range(6)), data)
        result = self.client.read(spec.name, 0)
        self.assertEqual(result.positions, ((2, 3, 4, 5),))
        self.assert_data_equal(result.data, rows(data, [2, 3, 4, 5]))

    def test_recurrent_and_hybrid(self) -> None:
        spec = CacheSpec("py-hybrid", DType.F16, 4, 64, 16, [
            Attention(2, 2, 4, rope=Rope.normal(4)),
            Recurrent(2, conv_tail=3, conv_dim=5, num_v_heads=2, head_v_dim=3, head_k_dim=2),
            Recurrent(1, conv_tail=2, conv_dim=3),
            Rotating(1, 1, 2, max_size=8)])
        layout = self.create(spec)
        # Sequences 5 then 3 in order of first appearance: states in that order.
        batch = [(5, 0), (3, 0), (5, 1), (3, 1), (5, 2)]
        data = random_data(layout, len(batch), 2)
        self.client.append(spec.name, batch, data)
        for seq, index, state in ((5, [0, 2, 4], 0), (3, [1, 3], 1)):
            result = self.client.read(spec.name, seq)
            self.assertEqual(result.states, (StateStatus.NONE, StateStatus.VALID,
                                             StateStatus.VALID, StateStatus.NONE))
            self.assertEqual(result.positions[1], ())
            self.assert_data_equal(result.data, rows(data, index, [state]))
        # A range that stops before the offset has no state.
        result = self.client.read(spec.name, 5, end=2)
        self.assertEqual(result.states[1], StateStatus.NONE)
        self.assertEqual(result.data[1].conv.shape, (2, 0, 3, 5))
        # Only the states, at the offset.
        result = self.client.read(spec.name, 5, begin=3)
        self.assertEqual(result.positions, ((), (), (), ()))
        self.assert_data_equal(result.data, rows(data, [], [0]))
        seqs = self.client.list_sequences(spec.name)
        self.assertEqual([(s.seq, s.offset, s.pending) for s in seqs], [(3, 2, 0), (5, 3, 0)])
        self.assertEqual(seqs[1].groups[1].state, StateStatus.VALID)
        # A contiguous cache refuses a gap, with the node's message.
        with self.assertRaisesRegex(kvmesh.InvalidArgument, "offset"):
            self.client.append(spec.name, [(5, 4)], random_data(layout, 1, 1))

    def test_speculation(self) -> None:
        spec = CacheSpec("py-spec", DType.F32, 2, 64, 8, [
            Attention(1, 1, 4), Recurrent(1, conv_tail=2, conv_dim=2, num_v_heads=1,
                                          head_v_dim=2, head_k_dim=2)])
        layout = self.create(spec)
        prompt = random_data(layout, 4, 1)
        self.client.append(spec.name, kvmesh.tokens(0, range(4)), prompt)
        draft = random_data(layout, 3, 3)  # one state per draft token
        self.client.append(spec.name, kvmesh.tokens(0, range(4, 7)), draft, speculative=True)
        self.assertEqual(self.client.list_sequences(spec.name)[0].pending, 3)
        with self.assertRaises(kvmesh.Aborted) as e:
            self.client.append(spec.name, [(0, 7)], random_data(layout, 1, 1))
        self.assertTrue(e.exception.retryable)
        with self.assertRaises(kvmesh.Aborted):
            self.client.snapshot(spec.name, 0)
        # Pending tokens are read back, with the state after the last one.
        result = self.client.read(spec.name, 0, begin=4)
        self.assert_data_equal(result.data, rows(draft, [0, 1, 2], [2]))
        self.assertEqual(self.client.commit_speculation(spec.name, 0, accepted=2), 6)
        result = self.client.read(spec.name, 0)
        self.assertEqual(result.positions[0], tuple(range(6)))
        self.assert_data_equal(result.data[1:], rows(draft, [], [1])[1:])
        with self.assertRaises(kvmesh.FailedPrecondition):
            self.client.commit_speculation(spec.name, 0, accepted=0)

    def test_resource_exhausted(self) -> None:
        spec = CacheSpec("py-full", DType.F16, 1, 8, 8, [Attention(1, 1, 4)])
        layout = self.create(spec)
        self.client.append(spec.name, [(0, 0)], layout.zeros(1))
        with self.assertRaisesRegex(kvmesh.ResourceExhausted, "max_sequences") as raised:
            self.client.append(spec.name, [(1, 0)], layout.zeros(1))
        # The numbers, from the status details (docs/api.md#error-details).
        self.assertEqual(raised.exception.shortage,
                         kvmesh.Shortage("SEQUENCES_EXHAUSTED", -1, needed=1, free=0, total=1))
        # 8 cells: 7 free; a batch of 8 more needs 8 (max_batch 8).
        with self.assertRaises(kvmesh.ResourceExhausted) as raised:
            self.client.append(spec.name, [(0, p) for p in range(1, 9)], layout.zeros(8))
        self.assertEqual(raised.exception.shortage,
                         kvmesh.Shortage("CELLS_EXHAUSTED", 0, needed=8, free=7, total=8))
        # A reservation holds back cells from other sequences (docs/api.md#reserve).
        spec2 = CacheSpec("py-reserve", DType.F16, 2, 8, 8, [Attention(1, 1, 4)])
        layout2 = self.create(spec2)
        usage = self.client.reserve(spec2.name, 0, 12, ttl=30)
        self.assertEqual(usage.groups[0].cells_reserved, 12)
        self.assertEqual(usage.sequences_reserved, 1)
        self.client.append(spec2.name, [(1, p) for p in range(4)], layout2.zeros(4))
        with self.assertRaises(kvmesh.ResourceExhausted) as raised:
            self.client.append(spec2.name, [(1, 4)], layout2.zeros(1))
        self.assertEqual(raised.exception.shortage,
                         kvmesh.Shortage("CELLS_EXHAUSTED", 0, needed=1, free=0, total=16))
        self.client.append(spec2.name, [(0, p) for p in range(8)], layout2.zeros(8))
        self.assertEqual(self.client.reserve(spec2.name, 0, 0).groups[0].cells_reserved, 0)
        with self.assertRaises(ValueError):
            self.client.reserve(spec2.name, 0, 1, ttl=0)
        # kvmeshctl prints the same numbers.
        out = nodes.run_ctl(self.node.address, "append", f"--cache={spec.name}", "--seq=1",
                            "--positions=0", check=False)
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("shortage: SEQUENCES_EXHAUSTED: needed 1, free 0 of 1", out.stderr)

    def test_lru_eviction_and_retention(self) -> None:
        # 2 sequences x 4 positions (docs/api.md#eviction).
        spec = CacheSpec("py-lru", DType.F16, 2, 4, 4, [Attention(1, 1, 4)], eviction="lru")
        layout = self.create(spec)
        self.assertEqual(self.client.get_cache(spec.name).spec.eviction, "lru")
        for seq in (1, 2):
            self.client.append(spec.name, [(seq, p) for p in range(4)], layout.zeros(4))
        info = self.client.set_retention(spec.name, 1, priority=3, pinned=True, ttl=60)
        self.assertEqual((info.seq, info.priority, info.pinned, info.ttl), (1, 3, True, 60.0))
        # 1 is pinned, so 2 makes room for 3, and an EVICTED event says so.
        batches = self.client.watch_events([spec.name], timeout=30)
        for batch in batches:
            if batch.synced:
                break
        self.client.append(spec.name, [(3, p) for p in range(4)], layout.zeros(4))
        evicted = next(e for b in batches for e in b.events if e.kind == "EVICTED")
        self.assertEqual((evicted.seq, evicted.offset, evicted.reason), (2, 4, "lru"))
        batches.close()
        listed = self.client.list_sequences(spec.name)
        self.assertEqual([s.seq for s in listed], [1, 3])
        self.assertGreaterEqual(listed[0].idle, 0.0)
        with self.assertRaises(kvmesh.NotFound) as raised:
            self.client.set_retention(spec.name, 2)
        self.assertIn("2", str(raised.exception))
        with self.assertRaises(ValueError):
            self.client.set_retention(spec.name, 1, ttl=0)
        with self.assertRaises(ValueError):
            CacheSpec("bad", DType.F16, 2, 4, 4, [Attention(1, 1, 4)], eviction="fifo")
        # kvmeshctl sets and lists it too.
        out = nodes.run_ctl(self.node.address, "set-retention", f"--cache={spec.name}", "--seq=3",
                            "--priority=2", "--pin", "--ttl=90s")
        self.assertIn("seq 3: priority 2, pinned, removed after 90000 ms unused", out.stdout)
        out = nodes.run_ctl(self.node.address, "list-sequences", f"--cache={spec.name}")
        self.assertIn("2p,1m30s", out.stdout)

    # ---- sequences -------------------------------------------------------------------------

    def test_token_ids(self) -> None:
        spec = CacheSpec("py-tokens", DType.F16, 4, 64, 16, [Attention(1, 1, 4)],
                         token_block_size=4)
        layout = self.create(spec)
        self.assertEqual(self.client.get_cache(spec.name).spec.token_block_size, 4)
        prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
        self.client.append(spec.name, kvmesh.tokens(0, range(6)), layout.zeros(6),
                           token_ids=prompt[:6])
        self.client.append(spec.name, kvmesh.tokens(0, range(6, 10)), layout.zeros(4),
                           token_ids=prompt[6:], stream=True, chunk_bytes=16)
        (seq,) = self.client.list_sequences(spec.name)
        self.assertEqual((seq.tokens, seq.exact_tokens, seq.token_blocks), (10, 10, 2))
        self.assertEqual(self.client.snapshot(spec.name, 0).tokens, 10)
        # A prompt that starts like seq 0 finds it; kvmeshctl says the same.
        matches = self.client.lookup_prefix(spec.name, prompt[:9] + [1, 2], max_matches=4)
        self.assertEqual(matches, [kvmesh.PrefixMatch(self.node.name, 0, 9, 10, True)])
        self.assertEqual(self.client.lookup_prefix(spec.name, [1, 2, 3, 4, 5]), [])
        # The cluster scope on a node without peers: its own matches, verified.
        self.assertEqual(self.client.lookup_prefix(spec.name, prompt[:9] + [1, 2], max_matches=4,
                                                   cluster=True, verify=True),
                         [kvmesh.PrefixMatch(self.node.name, 0, 9, 10, True, True)])
        # The events of that cache: a listing of seq 0's blocks, then a fork's.
        events = self.client.watch_events([spec.name], timeout=30)
        batch = next(events)
        while not batch.synced:
            batch = next(events)
        self.client.copy_prefix(spec.name, 0, 5, 8)
        seen = []
        while not any(e.kind == "BLOCKS" for e in seen):
            seen.extend(next(events).events)
        blocks = [e for e in seen if e.kind == "BLOCKS"][0]
        self.assertEqual((blocks.seq, blocks.offset, len(blocks.block_hashes)), (5, 8, 2))
        self.assertEqual(blocks.token_block_size, 4)
        events.close()
        out = nodes.run_ctl(self.node.address, "watch-events", f"--cache={spec.name}",
                            "--count=2")
        self.assertIn(f"listed BLOCKS           {spec.name} seq 0 offset 10: blocks kept 0, added 2",
                      out.stdout)
        self.assertIn(f"listed BLOCKS           {spec.name} seq 5 offset 8", out.stdout)
        out = nodes.run_ctl(self.node.address, "lookup-prefix", f"--cache={spec.name}",
                            "--tokens=7:16,1,2")
        self.assertIn(f"{self.node.name} seq 0: 9 of 11 tokens (offset 10)", out.stdout)
        out = nodes.run_ctl(self.node.address, "lookup-prefix", f"--cache={spec.name}",
                            "--tokens=7:16,1,2", "--scope=cluster", "--verify")
        self.assertIn(f"{self.node.name} seq 0: 9 of 11 tokens (offset 10)\n", out.stdout)
        with self.assertRaisesRegex(ValueError, "token_ids has 1 ids for 2 tokens"):
            self.client.append(spec.name, kvmesh.tokens(0, range(10, 12)), layout.zeros(2),
                               token_ids=[1])
        with self.assertRaisesRegex(kvmesh.InvalidArgument, r"token_ids\[0\] = -1"):
            self.client.append(spec.name, kvmesh.tokens(0, range(10, 11)), layout.zeros(1),
                               token_ids=[-1])

    def test_copy_prefix_remove_and_context_shift(self) -> None:
        for rope in (Rope.normal(4, 10000.0), Rope.neox(4, 500000.0, 0.5)):
            with self.subTest(rope=rope.type.name):
                spec = CacheSpec(f"py-shift-{rope.type.name}", DType.F32, 4, 64, 16,
                                 [Attention(1, 2, 6, head_dim_v=3, rope=rope)])
                layout = self.create(spec)
                data = random_data(layout, 10, 0)
                self.client.append(spec.name, kvmesh.tokens(0, range(10)), data)
                copied = self.client.copy_prefix(spec.name, 0, 1, 10, require_src_offset=10)
                self.assertEqual(copied, kvmesh.CopiedPrefix(10, None))
                with self.assertRaisesRegex(kvmesh.FailedPrecondition, "below the required 11"):
                    self.client.copy_prefix(spec.name, 0, 1, 10, require_src_offset=11)
                seqs = self.client.list_sequences(spec.name)
                self.assertEqual([s.groups[0].shared for s in seqs], [10, 10])
                # Context shift of seq 1: drop [2, 5); 5..9 become 2..6, keys re-rotated.
                self.assertEqual(self.client.remove(spec.name, 1, 2, 5), [])
                result = self.client.read(spec.name, 1)
                self.assertEqual(result.positions, (tuple(range(7)),))
                got = result.data[0]
                np.testing.assert_array_equal(got.k[:, :2], data[0].k[:, :2])
                np.testing.assert_array_equal(got.v[:, 2:], data[0].v[:, 5:])
                np.testing.assert_allclose(got.k[:, 2:], rope_shift(data[0].k[:, 5:], rope, -3),
                                           rtol=1e-6, atol=1e-6)
                # Elements past rope.dims are not rotated.
                np.testing.assert_array_equal(got.k[:, 2:, :, 4:], data[0].k[:, 5:, :, 4:])
                # The source of the fork is untouched.
                self.assert_data_equal(self.client.read(spec.name, 0).data, data)
                # Truncate, then drop.
                self.client.remove(spec.name, 1, 4)
                self.assertEqual(self.client.read(spec.name, 1).positions, ((0, 1, 2, 3),))
                self.client.remove(spec.name, 1, 0)
                with self.assertRaises(kvmesh.NotFound):
                    self.client.read(spec.name, 1)

    def test_remove_without_rope_cannot_shift(self) -> None:
        spec = CacheSpec("py-norope", DType.F16, 1, 16, 8, [Attention(1, 1, 4)])
        layout = self.create(spec)
        self.client.append(spec.name, kvmesh.tokens(0, range(4)), layout.zeros(4))
        with self.assertRaisesRegex(kvmesh.FailedPrecondition, "NONE|rope"):
            self.client.remove(spec.name, 0, 1, 2)

    def test_can_resume_and_visible(self) -> None:
        spec = CacheSpec("py-resume", DType.F16, 2, 64, 16,
                         [Attention(1, 1, 4, window=SlidingWindow(2, 4))])
        layout = self.create(spec)
        self.client.append(spec.name, kvmesh.tokens(0, range(8)), layout.zeros(8))
        # The next Append prunes below 8 - memory: positions 4.. stay.
        self.client.append(spec.name, kvmesh.tokens(0, range(8, 10)), layout.zeros(2))
        self.assertEqual(self.client.read(spec.name, 0).positions, (tuple(range(4, 10)),))
        self.assertTrue(self.client.can_resume(spec.name, 0, 10))
        self.assertFalse(self.client.can_resume(spec.name, 0, 2))
        self.assertFalse(self.client.can_resume(spec.name, 1, 3))
        self.assertEqual(self.client.visible(spec.name, 0, [(0, 9), (0, 6), (1, 0)]),
                         [[7, 8, 9], [4, 5, 6], []])
        self.assertEqual(self.client.visible(spec.name, 0, [(0, 5)], non_causal=True),
                         [[4, 5, 6, 7, 8, 9]])
        with self.assertRaises(kvmesh.InvalidArgument):
            self.client.visible(spec.name, 3, [(0, 7)])
        self.assertEqual(
            self.client.visible_ranges(spec.name, 0, [(0, 9), (0, 5), (1, 0)], non_causal=True),
            [[(7, 9)], [(4, 9)], []])
        with self.assertRaises(kvmesh.InvalidArgument):
            self.client.visible_ranges(spec.name, 3, [(0, 7)])

    # ---- snapshots -------------------------------------------------------------------------

    def test_snapshots(self) -> None:
        spec = CacheSpec("py-snap", DType.F16, 4, 64, 16, [Attention(2, 1, 4)])
        layout = self.create(spec)
        data = random_data(layout, 12, 0)
        self.client.append(spec.name, kvmesh.tokens(0, range(8)), rows(data, range(8)))
        first = self.client.snapshot(spec.name, 0)
        self.assertEqual((first.seq, first.from_offset, first.to_offset), (0, 0, 8))
        self.client.append(spec.name, kvmesh.tokens(0, range(8, 12)), rows(data, range(8, 12)))
        second = self.client.snapshot(spec.name, 0, from_offset=8)
        self.assertEqual((second.from_offset, second.to_offset), (8, 12))
        self.assertEqual([s.id for s in self.client.list_snapshots(spec.name)],
                         [first.id, second.id])
        merged = self.client.merge_snapshots(spec.name, first.id, second.id)
        self.assertEqual((merged.from_offset, merged.to_offset), (0, 12))
        self.assertEqual(merged.groups[0].stored, 12)
        # Fork from the checkpoint into seq 3, clamped at 10.
        self.client.restore(spec.name, 3, 10, snapshot_id=merged.id)
        self.assert_data_equal(self.client.read(spec.name, 3).data, rows(data, range(10)))
        split = self.client.split_snapshot(spec.name, merged.id, 5)
        assert split.parent is not None and split.child is not None
        self.assertEqual((split.parent.from_offset, split.parent.to_offset), (0, 5))
        self.assertEqual((split.child.from_offset, split.child.to_offset), (5, 12))
        # Live rewind.
        self.client.restore(spec.name, 0, 6)
        self.assertEqual(self.client.read(spec.name, 0).positions, (tuple(range(6)),))
        self.client.drop_snapshot(spec.name, split.parent.id)
        with self.assertRaises(kvmesh.NotFound):
            self.client.drop_snapshot(spec.name, split.parent.id)
        with self.assertRaises(kvmesh.NotFound):
            self.client.restore(spec.name, 0, 1, snapshot_id=merged.id)
        self.assertEqual([s.id for s in self.client.list_snapshots(spec.name)],
                         [split.child.id])
        self.assertEqual(self.client.get_cache(spec.name).usage.snapshots, 1)

    # ---- the node --------------------------------------------------------------------------

    def test_list_members_of_a_single_node(self) -> None:
        members = self.client.list_members()
        self.assertEqual(len(members), 1)
        me = members[0]
        self.assertEqual(me.name, "py-single")
        self.assertTrue(me.is_self)
        self.assertEqual(me.backend, "host")
        self.assertIn("grpc-stream", me.transports)
        self.assertIsInstance(me.boot_id, str)
        self.assertIsInstance(me.start_time_unix_ms, int)
        self.assertIsInstance(me.version, str)


class CrossCheckTest(nodes.NodeTestCase):
    """Python's layout agrees with kvmeshctl's (C++, service/ctl/payload.cc) byte for byte:
    kvmeshctl appends its pattern payload, Python reads it, appends it again in other batches
    (several sequences interleaved), and kvmeshctl verifies Python's data against its pattern;
    and the bytes of kvmeshctl's Read equal Python's encoding of what Python read."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.node = nodes.Node("py-cross")
        cls.client = kvmesh.Client(cls.node.address)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.node.stop_checked()

    def check(self, spec: CacheSpec, length: int) -> None:
        self.client.create_cache(spec)
        self.addCleanup(self.client.delete_cache, spec.name)
        layout = self.client.layout(spec.name)
        nodes.run_ctl(self.node.address, "append", f"--cache={spec.name}", "--seq=1",
                      f"--positions=0:{length}", "--seed=5")
        source = self.client.read(spec.name, 1)
        for group, positions in zip(spec.groups, source.positions):
            want = () if isinstance(group, Recurrent) else tuple(range(length))
            self.assertEqual(positions, want)
        # Sequences 2 and 3 interleaved, in two batches of rows in batch order, each with the
        # sequences' states in order of first appearance (3 first in the second batch). A plain
        # Append carries the state after the batch; the first batch carries the final state
        # (the one read at `length`) too, which the second batch then writes again.
        half = length // 2
        first = list(itertools.chain.from_iterable(((2, p), (3, p)) for p in range(half)))
        second = list(itertools.chain.from_iterable(((3, p), (2, p))
                                                    for p in range(half, length)))
        for batch in (first, second):
            self.client.append(spec.name, batch, rows(source.data, [p for _, p in batch], [0, 0]))
        for seq in (2, 3):
            out = nodes.run_ctl(self.node.address, "read", f"--cache={spec.name}", f"--seq={seq}",
                                "--verify-seed=5")
            self.assertNotIn("mismatch", out.stdout)
        # A shuffled copy fails kvmeshctl's check: the check sees rows, not just bytes.
        shuffled = list(reversed(range(length)))
        self.client.append(spec.name, kvmesh.tokens(4, range(length)),
                           rows(source.data, shuffled, [0]))
        bad = nodes.run_ctl(self.node.address, "read", f"--cache={spec.name}", "--seq=4",
                            "--verify-seed=5", check=False)
        self.assertNotEqual(bad.returncode, 0, bad.stdout)
        # kvmeshctl's raw Read bytes are Python's encoding.
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "read.bin")
            nodes.run_ctl(self.node.address, "read", f"--cache={spec.name}", "--seq=2",
                          f"--out={out_file}")
            with open(out_file, "rb") as f:
                raw = f.read()
        self.assertEqual(raw, source.payload)
        self.assertEqual(raw, layout.encode(source.data, length,
                                            [1 if s == StateStatus.VALID else 0
                                             for s in source.states]))

    def test_attention(self) -> None:
        for dtype in DType:
            with self.subTest(dtype=dtype.name):
                self.check(CacheSpec(f"py-x-{dtype.name}", dtype, 8, 64, 32,
                                     [Attention(3, 2, 8, head_dim_v=4), Attention(1, 3, 2)]), 6)

    def test_hybrid(self) -> None:
        for dtype in (DType.BF16, DType.F16):
            with self.subTest(dtype=dtype.name):
                self.check(CacheSpec(f"py-xh-{dtype.name}", dtype, 8, 64, 32, [
                    Attention(2, 2, 4, rope=Rope.normal(4)),
                    Recurrent(2, conv_tail=3, conv_dim=5, num_v_heads=2, head_v_dim=3,
                              head_k_dim=2),
                    Rotating(1, 1, 4, max_size=16),
                    Recurrent(1, conv_tail=2, conv_dim=3)]), 8)


def rope_shift(k: np.ndarray, rope: Rope, delta: int) -> np.ndarray:
    """docs/api.md, "RoPE shift": the first rope.dims elements of every head, rotated by
    delta positions in float32 (angles in double precision, rounded)."""
    half = rope.dims // 2
    i = np.arange(half, dtype=np.float64)
    theta = delta * np.float64(np.float32(rope.freq_scale)) * np.power(
        np.float64(np.float32(rope.base)), -2.0 * i / rope.dims)
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    out = k.astype(np.float32).copy()
    if rope.type == kvmesh.RopeType.NORMAL:
        a, b = np.arange(0, rope.dims, 2), np.arange(1, rope.dims, 2)
    else:
        a, b = np.arange(half), np.arange(half, rope.dims)
    x0, x1 = k[..., a].astype(np.float32), k[..., b].astype(np.float32)
    out[..., a] = x0 * cos - x1 * sin
    out[..., b] = x0 * sin + x1 * cos
    return out


if __name__ == "__main__":
    unittest.main()
