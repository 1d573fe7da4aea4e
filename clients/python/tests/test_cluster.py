"""The cluster calls of the Python client against two real nodes that know each other:
ListMembers, CopyPrefix from another node, Migrate, MigrateSnapshot, a cluster-scope Remove and
Drain, each with the data checked byte for byte on the other node."""

from __future__ import annotations

import unittest

import grpc
import numpy as np

import kvmesh
from kvmesh import Attention, CacheSpec, DType, Recurrent, Rope

import nodes

SPEC = CacheSpec("py-cluster", DType.BF16, max_sequences=8, capacity=64, max_batch=32,
                 groups=[Attention(2, 2, 8, rope=Rope.neox(8, 10000.0)),
                         Recurrent(1, conv_tail=2, conv_dim=4, num_v_heads=1, head_v_dim=2,
                                   head_k_dim=2)])


class ClusterTest(nodes.NodeTestCase):

    @classmethod
    def setUpClass(cls) -> None:
        cls.nodes = nodes.start_cluster(["py-a", "py-b"])
        cls.a = kvmesh.Client(cls.nodes[0].address)
        cls.b = kvmesh.Client(cls.nodes[1].address)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.a.close()
        cls.b.close()
        errors = []
        for node in cls.nodes:
            try:
                node.stop_checked()
            except AssertionError as error:
                errors.append(str(error))
        if errors:
            raise AssertionError("\n".join(errors))

    def setUp(self) -> None:
        for client in (self.a, self.b):
            client.create_cache(SPEC)
            self.addCleanup(client.delete_cache, SPEC.name)
        self.layout = self.a.layout(SPEC.name)
        rng = np.random.default_rng(7)
        self.data = self.layout.zeros(16, 1)
        for array in (self.data[0].k, self.data[0].v, self.data[1].conv):
            array[...] = rng.integers(0, 1 << 16, array.shape)
        self.data[1].delta[...] = rng.standard_normal(self.data[1].delta.shape)
        self.a.append(SPEC.name, kvmesh.tokens(0, range(16)), self.data)

    def assert_holds(self, client: kvmesh.Client, seq: int) -> None:
        """``client``'s node holds the 16 tokens and state appended in setUp as ``seq``."""
        result = client.read(SPEC.name, seq)
        self.assertEqual(result.positions[0], tuple(range(16)))
        np.testing.assert_array_equal(result.data[0].k, self.data[0].k)
        np.testing.assert_array_equal(result.data[0].v, self.data[0].v)
        np.testing.assert_array_equal(result.data[1].conv, self.data[1].conv)
        np.testing.assert_array_equal(result.data[1].delta, self.data[1].delta)

    def test_list_members(self) -> None:
        members = self.b.list_members()
        self.assertEqual([(m.name, m.is_self) for m in members],
                         [("py-b", True), ("py-a", False)])
        peer = members[1]
        self.assertEqual(peer.health, kvmesh.MemberHealth.SERVING)
        self.assertEqual(peer.address, self.nodes[0].address)
        self.assertEqual(peer.backend, "host")
        self.assertIn("grpc-stream", peer.transports)
        for m in members:
            self.assertIsInstance(m.boot_id, str)
            self.assertIsInstance(m.start_time_unix_ms, int)
            self.assertIsInstance(m.version, str)

    def test_copy_prefix_from_another_node(self) -> None:
        copied = self.b.copy_prefix(SPEC.name, 0, 5, 16, source_node="py-a",
                                    require_src_offset=16)
        transfer = copied.transfer
        assert transfer is not None
        self.assertEqual(copied.offset, 16)
        self.assertEqual(transfer.transport, "grpc-stream")
        self.assertGreater(transfer.bytes, 0)
        self.assert_holds(self.b, 5)
        self.assert_holds(self.a, 0)  # the source is unchanged
        # A recurrent state exists only at the offset: a shorter prefix is refused.
        with self.assertRaises(kvmesh.FailedPrecondition):
            self.b.copy_prefix(SPEC.name, 0, 6, 8, source_node="py-a")
        with self.assertRaisesRegex(kvmesh.InvalidArgument, "py-nobody"):
            self.b.copy_prefix(SPEC.name, 0, 6, 16, source_node="py-nobody")
        # A precondition the source does not meet: refused on the source, dst unchanged.
        with self.assertRaisesRegex(kvmesh.FailedPrecondition, "below the required 17"):
            self.b.copy_prefix(SPEC.name, 0, 5, 16, source_node="py-a", require_src_offset=17)
        self.assert_holds(self.b, 5)

    def test_incremental_copy_keeps_the_positions_dst_holds(self) -> None:
        # Full attention: a dst with the source's first token ids keeps those positions.
        spec = CacheSpec("py-incremental", DType.F16, 4, 64, 16, [Attention(1, 1, 4)])
        for client in (self.a, self.b):
            client.create_cache(spec)
            self.addCleanup(client.delete_cache, spec.name)
        layout = self.a.layout(spec.name)
        ids = list(range(300, 332))
        self.a.append(spec.name, kvmesh.tokens(1, range(16)), layout.zeros(16), token_ids=ids[:16])
        self.a.append(spec.name, kvmesh.tokens(1, range(16, 32)), layout.zeros(16),
                      token_ids=ids[16:])
        self.b.append(spec.name, kvmesh.tokens(2, range(12)), layout.zeros(12),
                      token_ids=ids[:12])
        copied = self.b.copy_prefix(spec.name, 1, 2, 32, source_node="py-a")
        self.assertEqual((copied.offset, copied.kept_positions), (32, 12))
        (seq,) = self.b.list_sequences(spec.name)
        self.assertEqual((seq.tokens, seq.exact_tokens), (32, 32))

    def test_migrate_and_cluster_remove(self) -> None:
        transfer = self.a.migrate(SPEC.name, 0, "py-b", target_seq=3)
        assert transfer is not None
        self.assertGreater(transfer.bytes, 0)
        self.assert_holds(self.b, 3)
        self.assertEqual(self.a.list_sequences(SPEC.name), [])
        with self.assertRaises(kvmesh.NotFound):
            self.a.migrate(SPEC.name, 0, "py-b")
        # Copy it back (keep_source), then remove seq 3 everywhere: one result per member.
        self.b.migrate(SPEC.name, 3, "py-a", keep_source=True)
        self.assert_holds(self.a, 3)
        results = self.a.remove(SPEC.name, 3, 0, cluster=True)
        self.assertEqual([(r.node, r.code) for r in results],
                         [("py-a", grpc.StatusCode.OK), ("py-b", grpc.StatusCode.OK)])
        self.assertTrue(all(r.ok for r in results))
        self.assertEqual(self.b.list_sequences(SPEC.name), [])

    def test_migrate_snapshot(self) -> None:
        snap = self.a.snapshot(SPEC.name, 0)
        moved = self.a.migrate_snapshot(SPEC.name, snap.id, "py-b")
        self.assertEqual((moved.snapshot.from_offset, moved.snapshot.to_offset), (0, 16))
        assert moved.transfer is not None
        self.assertEqual(self.a.list_snapshots(SPEC.name), [])
        self.b.restore(SPEC.name, 9, 16, snapshot_id=moved.snapshot.id)
        self.assert_holds(self.b, 9)

    def test_drain(self) -> None:
        snap = self.a.snapshot(SPEC.name, 0)
        result = self.a.drain(timeout_ms=20000)
        try:
            self.assertTrue(result.draining)
            self.assertEqual(result.stayed, ())
            self.assertEqual([(s.cache, s.seq, s.node) for s in result.sequences],
                             [(SPEC.name, 0, "py-b")])
            self.assertEqual([(s.snapshot_id, s.node) for s in result.snapshots],
                             [(snap.id, "py-b")])
            with self.assertRaisesRegex(kvmesh.Unavailable, "draining"):
                self.a.append(SPEC.name, [(1, 0)], self.layout.zeros(1, 1))
            self.assert_holds(self.b, result.sequences[0].target_seq)
        finally:
            self.assertFalse(self.a.drain(resume=True).draining)


if __name__ == "__main__":
    unittest.main()
