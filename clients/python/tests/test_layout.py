"""The payload layout without a node: docs/api.md's worked example byte by byte, the size
arithmetic, the client-side checks of shapes and dtypes, and the bfloat16 conversions."""

from __future__ import annotations

import unittest

import numpy as np

import kvmesh
from kvmesh import KV, Attention, CacheSpec, DType, PayloadLayout, Recurrent, Rotating, States


def worked_example_spec() -> CacheSpec:
    """docs/api.md, "Worked example": BF16, Attention (2 layers, 2 heads, dims 4) + Recurrent
    (1 layer, conv 2 x 3, 1 v head, 2 x 2)."""
    return CacheSpec("example", DType.BF16, max_sequences=4, capacity=16, max_batch=8,
                     groups=[Attention(num_layers=2, num_kv_heads=2, head_dim_k=4),
                             Recurrent(num_layers=1, conv_tail=2, conv_dim=3, num_v_heads=1,
                                       head_v_dim=2, head_k_dim=2)])


class WorkedExampleTest(unittest.TestCase):
    """Every byte range of the worked example's table holds what the table says."""

    def setUp(self) -> None:
        self.layout = PayloadLayout(worked_example_spec())
        self.tokens = [(7, 0), (9, 0), (7, 1)]

    def test_sizes(self) -> None:
        self.assertEqual(self.layout.append_bytes(self.tokens), 248)
        self.assertEqual(self.layout.append_bytes(self.tokens, speculative=True), 276)
        # Read(seq 7) afterwards: two positions in group 0 and one state in group 1.
        self.assertEqual(self.layout.payload_bytes([2, 0], [0, 1]), 156)
        self.assertEqual(self.layout.token_bytes(0), 2 * 2 * 4 * 2 * 2)
        self.assertEqual(self.layout.state_bytes(1), 28)
        self.assertEqual(kvmesh.count_states(self.tokens), 2)
        self.assertEqual(self.layout.max_append_bytes(), 8 * 64 + 8 * 28)

    def test_byte_ranges(self) -> None:
        # Every bf16 element's bits name its place: 10000 * d + 1000 * layer + 100 * (V) +
        # 10 * token + head; the delta state is float32.
        kv = self.layout.zeros(3, 2)[0]
        for layer in range(2):
            for t in range(3):
                for h in range(2):
                    for d in range(4):
                        kv.k[layer, t, h, d] = 1000 * layer + 10 * t + h + d * 10000
                        kv.v[layer, t, h, d] = 1000 * layer + 100 + 10 * t + h + d * 10000
        conv = np.array([[[[1, 2, 3], [4, 5, 6]], [[11, 12, 13], [14, 15, 16]]]], np.uint16)
        delta = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 2, 2) + 0.5
        payload = self.layout.encode([kv, States(conv, delta)], 3, 2)
        self.assertEqual(len(payload), 248)

        def u16(begin: int, end: int) -> np.ndarray:
            return np.frombuffer(payload[begin:end], "<u2")

        # 0-47: group 0, layer 0, K of tokens 0, 1, 2 (heads 0, 1), 16 bytes each.
        np.testing.assert_array_equal(u16(0, 48), kv.k[0].reshape(-1))
        np.testing.assert_array_equal(u16(48, 96), kv.v[0].reshape(-1))
        np.testing.assert_array_equal(u16(96, 144), kv.k[1].reshape(-1))
        np.testing.assert_array_equal(u16(144, 192), kv.v[1].reshape(-1))
        # Element (t, h, d) of a K block at ((t * heads + h) * head_dim_k + d) * 2.
        t, h, d = 2, 1, 3
        self.assertEqual(u16(96, 144)[(t * 2 + h) * 4 + d], kv.k[1, t, h, d])
        # 192-203: seq 7's conv [2][3] bf16; 204-219: its delta f32; then seq 9's.
        np.testing.assert_array_equal(u16(192, 204), [1, 2, 3, 4, 5, 6])
        np.testing.assert_array_equal(np.frombuffer(payload[204:220], "<f4"),
                                      [0.5, 1.5, 2.5, 3.5])
        np.testing.assert_array_equal(u16(220, 232), [11, 12, 13, 14, 15, 16])
        np.testing.assert_array_equal(np.frombuffer(payload[232:248], "<f4"),
                                      [4.5, 5.5, 6.5, 7.5])

        decoded = self.layout.decode(payload, 3, 2)
        np.testing.assert_array_equal(decoded[0].k, kv.k)
        np.testing.assert_array_equal(decoded[0].v, kv.v)
        np.testing.assert_array_equal(decoded[1].conv, conv)
        np.testing.assert_array_equal(decoded[1].delta, delta)

    def test_speculative_states_follow_the_tokens(self) -> None:
        data = self.layout.zeros(3, 3)
        data[1].conv[0, :, 0, 0] = [10, 20, 30]
        payload = self.layout.encode(data, 3, 3)
        self.assertEqual(len(payload), 276)
        for i, value in enumerate([10, 20, 30]):
            self.assertEqual(np.frombuffer(payload[192 + 28 * i:194 + 28 * i], "<u2")[0], value)


class ChecksTest(unittest.TestCase):
    """Data that does not fit the layout is a ValueError that says what was expected."""

    def setUp(self) -> None:
        self.spec = CacheSpec("c", DType.F16, 4, 64, 16, [
            Attention(2, 2, 8, head_dim_v=4),
            Rotating(1, 1, 4, max_size=8),
            Recurrent(3, conv_tail=3, conv_dim=5)])
        self.layout = PayloadLayout(self.spec)

    def test_shapes(self) -> None:
        data = self.layout.zeros(5, 2)
        self.assertEqual(data[0].k.shape, (2, 5, 2, 8))
        self.assertEqual(data[0].v.shape, (2, 5, 2, 4))
        self.assertEqual(data[1].k.shape, (1, 5, 1, 4))
        self.assertEqual(data[2].conv.shape, (3, 2, 3, 5))
        self.assertIsNone(data[2].delta)  # conv-only
        self.assertEqual(self.layout.shapes(0, 5, 2), {"k": (2, 5, 2, 8), "v": (2, 5, 2, 4)})
        self.assertEqual(len(self.layout.encode(data, 5, 2)),
                         5 * (2 * 2 * 12 * 2 + 1 * 8 * 2) + 2 * 3 * 15 * 2)

    def test_wrong_shape(self) -> None:
        data = self.layout.zeros(5, 2)
        data[0] = KV(np.zeros((2, 4, 2, 8), np.float16), data[0].v)
        with self.assertRaisesRegex(ValueError, r"groups\[0\] \(Attention\): k has shape "
                                    r"\(2, 4, 2, 8\); the layout needs \(2, 5, 2, 8\) = "
                                    r"\[num_layers, tokens, num_kv_heads, head_dim_k\]"):
            self.layout.encode(data, 5, 2)
        data = self.layout.zeros(5, 1)
        with self.assertRaisesRegex(ValueError, r"groups\[2\] \(Recurrent\): conv has shape "
                                    r"\(3, 1, 3, 5\); the layout needs \(3, 2, 3, 5\)"):
            self.layout.encode(data, 5, 2)

    def test_wrong_dtype(self) -> None:
        data = self.layout.zeros(5, 2)
        data[1] = KV(data[1].k.astype(np.float32), data[1].v)
        with self.assertRaisesRegex(ValueError, r"groups\[1\] \(Rotating\): k is float32; a "
                                    r"F16 cache takes float16"):
            self.layout.encode(data, 5, 2)

    def test_wrong_kind_or_count(self) -> None:
        data = self.layout.zeros(5, 2)
        with self.assertRaisesRegex(ValueError, "needs data for 3 group"):
            self.layout.encode(data[:2], 5, 2)
        data[2] = KV(data[0].k, data[0].v)
        with self.assertRaisesRegex(ValueError, r"groups\[2\] \(Recurrent\): needs a States"):
            self.layout.encode(data, 5, 2)

    def test_decode_size(self) -> None:
        with self.assertRaisesRegex(ValueError, "the payload has 3 bytes; the layout needs"):
            self.layout.decode(b"abc", 1, 1)

    def test_big_endian_input_is_stored_little_endian(self) -> None:
        spec = CacheSpec("c", DType.F32, 1, 8, 8, [Attention(1, 1, 2)])
        layout = PayloadLayout(spec)
        k = np.array([[[[1.5, -2.0]]]], dtype=">f4")
        payload = layout.encode([KV(k, k)], 1, 0)
        np.testing.assert_array_equal(np.frombuffer(payload, "<f4"), [1.5, -2.0, 1.5, -2.0])


class BFloat16Test(unittest.TestCase):

    def test_round_trip_and_rounding(self) -> None:
        values = np.array([0.0, 1.0, -2.5, 3.140625, 1e30, -1e-30], np.float32)
        bits = kvmesh.to_bfloat16(values)
        self.assertEqual(bits.dtype, np.dtype("<u2"))
        np.testing.assert_array_equal(kvmesh.from_bfloat16(bits)[:4], values[:4])
        # Ties go to even: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
        self.assertEqual(kvmesh.to_bfloat16(np.float32(1 + 2 ** -8)), 0x3F80)
        self.assertEqual(kvmesh.to_bfloat16(np.float32(1 + 3 * 2 ** -8)), 0x3F82)
        self.assertTrue(np.isnan(kvmesh.from_bfloat16(kvmesh.to_bfloat16(np.float32("nan")))))

    def test_bf16_cache_takes_uint16(self) -> None:
        layout = PayloadLayout(CacheSpec("b", DType.BF16, 1, 8, 8, [Attention(1, 1, 2)]))
        self.assertEqual(layout.dtype, np.dtype("<u2"))
        k = np.zeros((1, 1, 1, 2), np.float16)
        with self.assertRaisesRegex(ValueError, "a BF16 cache takes uint16 bfloat16 bits"):
            layout.encode([KV(k, k)], 1, 0)


class SpecTest(unittest.TestCase):

    def test_defaults_and_types(self) -> None:
        a = Attention(4, 2, 64)
        self.assertEqual(a.head_dim_v, 64)
        self.assertEqual(a.window, kvmesh.FullWindow())
        spec = CacheSpec("s", 2, 1, 8, 8, [a, Rotating(1, 1, 8, max_size=4)])
        self.assertIs(spec.dtype, DType.F16)
        self.assertIsInstance(spec.groups, tuple)
        self.assertTrue(spec.contiguous)
        with self.assertRaisesRegex(TypeError, r"groups\[0\] is a dict"):
            CacheSpec("s", DType.F16, 1, 8, 8, [{"num_layers": 1}])



class RangesTest(unittest.TestCase):
    """visible_ranges' fallback for a node that answers in positions."""

    def test_positions_become_maximal_ranges(self) -> None:
        from kvmesh.client import _ranges
        self.assertEqual(_ranges([]), [])
        self.assertEqual(_ranges([5]), [(5, 5)])
        self.assertEqual(_ranges([0, 1, 2, 4, 6, 7]), [(0, 2), (4, 4), (6, 7)])
        self.assertEqual(_ranges([2147483645, 2147483646]), [(2147483645, 2147483646)])


if __name__ == "__main__":
    unittest.main()
