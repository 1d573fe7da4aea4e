"""The reference worker (reference_worker.py) against two real kvmesh-node processes with
--local-socket, a cluster of two: scenarios (a)-(d) in float32 and bfloat16, each equality as
the worker states it (bit for bit, or within rounding for a context shift). ctest label worker.
"""

from __future__ import annotations

import os
import tempfile
import unittest

import torch

import kvmesh
import kvmesh.local
import nodes
import reference_worker as worker


class ReferenceWorkerTest(nodes.NodeTestCase):
    """On host memory (memfds)."""

    backend_args: list = []

    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = tempfile.TemporaryDirectory(prefix="kvmesh-worker-")
        names = ["worker-a", "worker-b"]
        cls.sockets = [os.path.join(cls.dir.name, f"{n}.sock") for n in names]
        ports = {n: nodes.reserve_port() for n in names}
        cls.nodes = []
        try:
            for name, path in zip(names, cls.sockets):
                peers = {n: f"127.0.0.1:{p}" for n, p in ports.items() if n != name}
                cls.nodes.append(nodes.Node(name, port=ports[name], peers=peers,
                                            args=[f"--local-socket={path}"] + cls.backend_args))
        except Exception:
            for node in cls.nodes:
                node.stop()
            cls.dir.cleanup()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        for node in cls.nodes:
            node.stop_checked()
        cls.dir.cleanup()

    def run_scenarios(self, dtype: str, hybrid: bool = False) -> None:
        a, b = self.nodes
        config = worker.Config(dtype=dtype,
                               layers=worker.HYBRID if hybrid else worker.Config.layers)
        checks = worker.run_all(config, a.address, self.sockets[0], a.name, b.address,
                                self.sockets[1])
        names = [c.name[:3] for c in checks]
        shape = f"{dtype}{', hybrid' if hybrid else ''}"
        for check in checks:
            print(f"{shape}: {check.line()}")
            self.assertTrue(check.ok, check.line())
            self.assertGreater(check.compared, 0, check.line())
        if hybrid:  # (b): refused, then a continuation bit for bit
            self.assertEqual(names, ["(a)", "(b)", "(c)", "(d)"])
            self.assertEqual([c.exact for c in checks], [True, True, True, True])
        else:
            self.assertEqual(names, ["(a)", "(b)", "(b)", "(c)", "(d)"])
            # What is claimed bit for bit is compared bit for bit.
            self.assertEqual([c.exact for c in checks], [True, False, False, True, True])

    def test_float32(self) -> None:
        self.run_scenarios("f32")

    def test_bfloat16(self) -> None:
        self.run_scenarios("bf16")

    def test_hybrid_float32(self) -> None:
        """A ring (Rotating group) and an LFM2-style conv state (Recurrent group) in place."""
        self.run_scenarios("f32", hybrid=True)

    def test_hybrid_bfloat16(self) -> None:
        self.run_scenarios("bf16", hybrid=True)

    def test_a_changed_cell_is_seen(self) -> None:
        """The checks can fail: one key written wrongly in place changes the logits."""
        a, b = self.nodes
        model = worker.Model(worker.Config())
        spec = model.config.spec("worker-tamper", capacity=64)
        with kvmesh.Client(a.address) as client:
            client.create_cache(spec)
            try:
                with kvmesh.local.Session(self.sockets[0]) as session, \
                        worker.attached(session, model, spec.name) as cache:
                    ids = list(range(1, 13))
                    cache.run(0, range(10), ids[:10])
                    pin = session.pin(spec.name, 0, 3, 4)
                    cache.k_rows[0][int(pin.cells[0][0])] += 1e-3
                    session.unpin(pin)
                    got = cache.run(0, [10, 11], ids[10:])
                    want = worker.recompute(model, ids)[10:]
                    self.assertFalse(torch.equal(got, want))
            finally:
                client.delete_cache(spec.name)

    def test_a_changed_ring_row_or_conv_state_is_seen(self) -> None:
        """The hybrid checks can fail: a ring row or a conv state changed in place changes the
        logits, and the untouched sequence still equals the recomputation."""
        a, _ = self.nodes
        model = worker.Model(worker.Config(layers=worker.HYBRID))
        spec = model.config.spec("worker-tamper-hybrid", capacity=64)
        ids = list(range(1, 13))
        want = worker.recompute(model, ids)[10:]
        with kvmesh.Client(a.address) as client:
            client.create_cache(spec)
            try:
                with kvmesh.local.Session(self.sockets[0]) as session, \
                        worker.attached(session, model, spec.name) as cache:
                    for seq, layer in ((0, None), (1, 1), (2, 2)):  # untouched, ring, conv
                        cache.run(seq, range(10), ids[:10])
                        if layer is not None:
                            group, _ = model.config.layer_slot(layer)
                            pin = session.pin(spec.name, seq, 9)
                            rows = cache.k_rows[1] if layer == 1 else cache.state_rows[2]
                            rows[int(pin.cells[group][0])] += 1e-2
                            del rows  # a view: the mapping closes only without views
                            session.unpin(pin)
                        got = cache.run(seq, [10, 11], ids[10:])
                        self.assertEqual(torch.equal(got, want), layer is None, f"seq {seq}")
            finally:
                client.delete_cache(spec.name)


@unittest.skipUnless(os.environ.get("KVMESH_CUDA_DRIVER"),
                     "KVMESH_CUDA_DRIVER names no CUDA driver (ctest sets the simulated GPU's in a "
                     "-DKVMESH_CUDA=SIM build)")
class ReferenceWorkerCudaTest(ReferenceWorkerTest):
    """On GPU memory: the nodes run --backend=cuda, and the worker imports each group's memory
    through the CUDA driver (kvmesh.local._CudaDriver); in the SIM build, the simulated GPU's."""

    backend_args = ["--backend=cuda", "--transport=grpc-stream"]

    def test_groups_are_gpu_memory(self) -> None:
        a, _ = self.nodes
        model = worker.Model(worker.Config())
        spec = model.config.spec("worker-gpu", capacity=64)
        with kvmesh.Client(a.address) as client:
            client.create_cache(spec)
            try:
                with kvmesh.local.Session(self.sockets[0]) as session:
                    cache = session.attach(spec.name)
                    for g in cache.groups:
                        self.assertIsNone(g.memory)
                        self.assertEqual(g.device, 0)
                        self.assertNotEqual(g.device_pointer, 0)
                        self.assertEqual(g.bytes % (2 << 20), 0)
                    cache.close()
            finally:
                client.delete_cache(spec.name)


if __name__ == "__main__":
    unittest.main()
