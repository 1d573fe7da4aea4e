"""kvmesh.local against a real kvmesh-node with --local-socket: the rows a worker sees in place
are the K/V gRPC stored, a row written in place is what gRPC reads next, and refusals raise the
status code's exception."""

from __future__ import annotations

import os
import tempfile
import unittest

import numpy as np

import kvmesh
import kvmesh.local
from kvmesh import KV, Attention, CacheSpec, DType

import nodes


class LocalTest(nodes.NodeTestCase):

    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.TemporaryDirectory(prefix="kvmesh-local-py-")
        cls.socket = os.path.join(cls.dir.name, "local.sock")
        cls.node = nodes.Node("local-py", args=[f"--local-socket={cls.socket}"])
        cls.client = kvmesh.Client(cls.node.address)
        cls.spec = CacheSpec("m", DType.F32, max_sequences=4, capacity=32, max_batch=16,
                             groups=[Attention(num_layers=2, num_kv_heads=2, head_dim_k=4)])
        cls.client.create_cache(cls.spec)
        rng = np.random.default_rng(7)
        cls.k = rng.standard_normal((2, 10, 2, 4), dtype=np.float32)
        cls.v = rng.standard_normal((2, 10, 2, 4), dtype=np.float32)
        cls.client.append("m", kvmesh.tokens(0, range(10)), [KV(cls.k, cls.v)])

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.node.stop_checked()
        cls.dir.cleanup()

    def test_pinned_cells_hold_the_stored_kv_and_take_writes_in_place(self) -> None:
        with kvmesh.local.Session(self.socket) as session:
            self.assertEqual(session.tenant, "default")
            self.assertEqual(session.node, "local-py")
            cache = session.attach("m")
            self.assertEqual(cache.spec.name, "m")
            self.assertEqual(len(cache.groups[0].planes), 4)  # K, V of two layers
            pin = session.pin("m", seq=0, begin=2, end=8)
            np.testing.assert_array_equal(pin.positions[0], np.arange(2, 8))
            for layer in range(2):
                k = cache.rows(0, 2 * layer, np.float32)[pin.cells[0]].reshape(6, 2, 4)
                v = cache.rows(0, 2 * layer + 1, np.float32)[pin.cells[0]].reshape(6, 2, 4)
                np.testing.assert_array_equal(k, self.k[layer, 2:8])
                np.testing.assert_array_equal(v, self.v[layer, 2:8])
            # Layer 1's V of position 2, written in place, is what gRPC reads.
            cache.rows(0, 3, np.float32)[pin.cells[0][0]] = 7.5
            read = self.client.read("m", seq=0, begin=2, end=3)
            np.testing.assert_array_equal(read.data[0].v[1], np.full((1, 2, 4), 7.5, np.float32))
            np.testing.assert_array_equal(read.data[0].k[1, 0], self.k[1, 2])
            session.unpin(pin)
            with self.assertRaises(kvmesh.NotFound):
                session.unpin(pin)
            del k, v
            cache.close()

    def test_an_append_written_in_place_is_what_grpc_reads(self) -> None:
        rng = np.random.default_rng(11)
        k = rng.standard_normal((2, 3, 2, 4), dtype=np.float32)
        v = rng.standard_normal((2, 3, 2, 4), dtype=np.float32)
        with kvmesh.local.Session(self.socket) as session:
            cache = session.attach("m")
            plan = session.begin_append("m", kvmesh.tokens(1, range(3)), token_ids=[5, 6, 7])
            self.assertEqual(len(plan.cells[0]), 3)
            with self.assertRaises(kvmesh.NotFound):
                self.client.read("m", seq=1)
            for layer in range(2):
                cache.rows(0, 2 * layer, np.float32)[plan.cells[0]] = k[layer].reshape(3, 8)
                cache.rows(0, 2 * layer + 1, np.float32)[plan.cells[0]] = v[layer].reshape(3, 8)
            session.commit_append(plan)
            read = self.client.read("m", seq=1)
            np.testing.assert_array_equal(read.data[0].k, k)
            np.testing.assert_array_equal(read.data[0].v, v)
            abandoned = session.begin_append("m", kvmesh.tokens(2, range(2)))
            session.abandon_append(abandoned)
            with self.assertRaises(kvmesh.NotFound):
                session.commit_append(abandoned)
            with self.assertRaises(kvmesh.NotFound):
                self.client.read("m", seq=2)
            cache.close()
        self.client.remove("m", seq=1, begin=0)

    def test_refusals_raise_their_codes(self) -> None:
        with kvmesh.local.Session(self.socket) as session:
            with self.assertRaises(kvmesh.NotFound):
                session.attach("nope")
            with self.assertRaises(kvmesh.NotFound):
                session.pin("m", seq=3)
            with self.assertRaises(kvmesh.InvalidArgument) as raised:
                session.pin("m", seq=0, lease=3600)
            self.assertIn("lease_ms = 3600000", raised.exception.message)
            # The session goes on after a refusal.
            self.assertEqual(len(session.pin("m", seq=0).cells[0]), 10)
        with self.assertRaises(kvmesh.Unavailable):
            kvmesh.local.Session(os.path.join(self.dir.name, "absent.sock"))


if __name__ == "__main__":
    unittest.main()
