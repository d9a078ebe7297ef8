"""Pure tests of vroll_client.weights: checksums, dtype packing, chunking. No worker needed."""
import struct
import unittest

import numpy as np
import torch
import xxhash

from vroll_client import chunk_ranges, tensor_checksum, to_wire, weights_checksum
from vroll_client.weights import wire_weights_checksum
from fake_worker import reference_weights_checksum


class WeightsChecksumTest(unittest.TestCase):
    def test_worked_example_of_weight_update_h(self):
        # policy/weight_update.h WeightsChecksum: {"a": [1.0, 2.0], "b": [-0.5]}.
        tensors = {"b": np.array([-0.5], np.float32), "a": np.array([1.0, 2.0], np.float32)}
        self.assertEqual(weights_checksum(tensors), 0xCAC5FEA618160D40)

    def test_worked_example_stream_bytes(self):
        self.assertEqual(xxhash.xxh3_64_intdigest(bytes.fromhex("0000803f00000040")), 0x4DE8D78F7134F4B7)
        self.assertEqual(xxhash.xxh3_64_intdigest(bytes.fromhex("000000bf")), 0x7D99FBE36C125803)
        stream = bytes.fromhex("0100000000000000" "61" "0800000000000000" "b7f434718fd7e84d"
                               "0100000000000000" "62" "0400000000000000" "0358126ce3fb997d")
        self.assertEqual(len(stream), 50)
        self.assertEqual(xxhash.xxh3_64_intdigest(stream), 0xCAC5FEA618160D40)

    def test_wire_checksum_reuses_fp32_manifest_checksums(self):
        tensors = {"a": np.array([1.0, 2.0], np.float32),
                   "h": torch.tensor([0.5, -3.0], dtype=torch.float16),
                   "g": torch.tensor([1.0 / 3.0], dtype=torch.bfloat16)}
        wire = [to_wire(name, value) for name, value in tensors.items()]
        self.assertEqual(wire_weights_checksum(wire, tensors), weights_checksum(tensors))
        self.assertEqual(wire_weights_checksum(wire, tensors),
                         reference_weights_checksum({n: (v.float().numpy() if isinstance(v, torch.Tensor) else v)
                                                     for n, v in tensors.items()}))

    def test_empty_set_hashes_to_xxh3_of_nothing(self):
        self.assertEqual(weights_checksum({}), 0x2D06800538D394C2)

    def test_torch_fp32_fp16_bf16_hash_their_float32_values(self):
        values = torch.tensor([[1.0, -2.5], [0.125, 3.0]])  # exact in fp16 and bf16
        expected = weights_checksum({"w": values.numpy()})
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            with self.subTest(dtype=dtype):
                self.assertEqual(weights_checksum({"w": values.to(dtype)}), expected)
        self.assertEqual(weights_checksum({"w": values.numpy().astype(np.float16)}), expected)

    def test_rounded_bf16_hashes_the_rounded_values(self):
        t = torch.tensor([1.0 / 3.0, 1e-3])
        bf = t.to(torch.bfloat16)
        self.assertEqual(weights_checksum({"w": bf}), weights_checksum({"w": bf.float()}))
        self.assertNotEqual(weights_checksum({"w": bf}), weights_checksum({"w": t}))

    def test_names_sort_as_utf8_bytes_and_shapes_are_not_hashed(self):
        tensors = {"model.norm.weight": np.ones(4, np.float32),
                   "model.embed_tokens.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
                   "lm_head.weight": np.full((3, 1), 0.5, np.float32)}
        self.assertEqual(weights_checksum(tensors), reference_weights_checksum(tensors))
        reshaped = dict(tensors, **{"model.embed_tokens.weight": np.arange(6, dtype=np.float32)})
        self.assertEqual(weights_checksum(reshaped), weights_checksum(tensors))

    def test_non_contiguous_and_big_endian_inputs(self):
        base = np.arange(12, dtype=np.float32).reshape(3, 4)
        expected = weights_checksum({"w": np.ascontiguousarray(base.T)})
        self.assertEqual(weights_checksum({"w": base.T}), expected)
        self.assertEqual(weights_checksum({"w": torch.from_numpy(base).t()}), expected)
        self.assertEqual(weights_checksum({"w": base.T.astype(">f4")}), expected)

    def test_a_lazily_negated_view_is_sent_with_its_values(self):
        expected = np.array([-2.0, 4.0], np.float32)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            with self.subTest(dtype=dtype):
                negated = torch.tensor([2.0, -4.0], dtype=dtype)._neg_view()  # no numpy() or view() of its own
                self.assertTrue(negated.is_neg() and negated.is_contiguous())
                self.assertEqual(weights_checksum({"w": negated}), weights_checksum({"w": expected}))
                self.assertEqual(bytes(to_wire("w", negated).data),
                                 bytes(to_wire("w", torch.from_numpy(expected).to(dtype)).data))

    def test_a_meta_tensor_is_a_type_error(self):
        with self.assertRaisesRegex(TypeError, "'w'.*meta"):
            weights_checksum({"w": torch.empty(4, device="meta")})
        with self.assertRaisesRegex(TypeError, "'w'.*meta"):
            to_wire("w", torch.empty(4, device="meta"))

    def test_refuses_other_dtypes_and_types(self):
        with self.assertRaisesRegex(TypeError, "'w'.*float64"):
            weights_checksum({"w": np.zeros(2)})
        with self.assertRaisesRegex(TypeError, "'w'.*int"):
            weights_checksum({"w": torch.zeros(2, dtype=torch.int32)})
        with self.assertRaisesRegex(TypeError, "list"):
            weights_checksum({"w": [1.0]})
        with self.assertRaisesRegex(TypeError, "not a str"):
            weights_checksum({1: np.zeros(2, np.float32)})


class ToWireTest(unittest.TestCase):
    def test_fp32_bytes_are_little_endian_binary32_and_zero_copy(self):
        t = torch.tensor([[1.0, 2.0], [-0.5, 0.0]])
        w = to_wire("x", t)
        self.assertEqual((w.dtype, w.shape, w.num_bytes), ("float32", (2, 2), 16))
        self.assertEqual(bytes(w.data), struct.pack("<4f", 1.0, 2.0, -0.5, 0.0))
        self.assertEqual(w.checksum, xxhash.xxh3_64_intdigest(bytes(w.data)))
        t[0, 0] = 9.0  # the wire view aliases the tensor's memory
        self.assertEqual(bytes(w.data[:4]), struct.pack("<f", 9.0))

    def test_fp16_bytes_are_binary16(self):
        w = to_wire("x", torch.tensor([1.0, -2.0, 65504.0], dtype=torch.float16))
        self.assertEqual(w.dtype, "float16")
        self.assertEqual(bytes(w.data), bytes.fromhex("003c" "00c0" "ff7b"))
        w = to_wire("x", np.array([1.0, -2.0, 65504.0], dtype=">f2"))  # big-endian input
        self.assertEqual(bytes(w.data), bytes.fromhex("003c" "00c0" "ff7b"))

    def test_bf16_bytes_are_the_upper_halves_of_binary32(self):
        values = [1.0, -2.0, 0.15625, float("inf"), -0.0]
        w = to_wire("x", torch.tensor(values, dtype=torch.bfloat16))
        self.assertEqual(w.dtype, "bfloat16")
        expected = b"".join(struct.pack("<f", v)[2:] for v in values)
        self.assertEqual(bytes(w.data), expected)
        self.assertEqual(bytes(w.data), bytes.fromhex("803f" "00c0" "203e" "807f" "0080"))
        self.assertEqual(w.checksum, tensor_checksum(expected))

    def test_bf16_rounded_value_roundtrips_through_shift(self):
        t = torch.randn(17, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        w = to_wire("x", t)
        words = np.frombuffer(bytes(w.data), dtype="<u2").astype(np.uint32) << 16
        np.testing.assert_array_equal(words.view(np.float32), t.float().numpy())

    def test_non_contiguous_tensor_and_scalar(self):
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
        w = to_wire("x", t)
        self.assertEqual(w.shape, (3, 2))
        self.assertEqual(bytes(w.data), t.contiguous().numpy().tobytes())
        s = to_wire("s", torch.tensor(2.0, dtype=torch.bfloat16))
        self.assertEqual((s.shape, bytes(s.data)), ((), struct.pack("<f", 2.0)[2:]))
        # A 0-d numpy array keeps shape () too (np.ascontiguousarray would make it (1,)), in
        # either byte order.
        for a in (np.array(1.5, dtype="<f4"), np.array(1.5, dtype=">f4")):
            w = to_wire("a", a)
            self.assertEqual((w.shape, bytes(w.data)), ((), struct.pack("<f", 1.5)))

    def test_requires_grad_parameter_is_accepted(self):
        p = torch.nn.Parameter(torch.ones(3))
        self.assertEqual(bytes(to_wire("p", p).data), struct.pack("<3f", 1, 1, 1))

    def test_refuses_float64_and_ints(self):
        with self.assertRaisesRegex(TypeError, "float64.*float\\(\\)"):
            to_wire("w", torch.zeros(2, dtype=torch.float64))
        with self.assertRaisesRegex(TypeError, "int64"):
            to_wire("w", np.zeros(2, np.int64))


class ChunkRangesTest(unittest.TestCase):
    def assert_covers_once(self, num_bytes, chunk_bytes):
        ranges = chunk_ranges(num_bytes, chunk_bytes)
        seen = np.zeros(num_bytes, np.int64)
        for offset, length in ranges:
            self.assertGreater(length, 0)
            self.assertLessEqual(length, chunk_bytes)
            seen[offset:offset + length] += 1
        np.testing.assert_array_equal(seen, np.ones(num_bytes, np.int64))
        self.assertEqual(len(ranges), -(-num_bytes // chunk_bytes))

    def test_every_byte_exactly_once(self):
        for num_bytes in (1, 2, 3, 15, 16, 17, 100, 4096, 4097):
            for chunk_bytes in (1, 3, 7, 16, 100, 1 << 20):
                with self.subTest(num_bytes=num_bytes, chunk_bytes=chunk_bytes):
                    self.assert_covers_once(num_bytes, chunk_bytes)

    def test_exact_ranges(self):
        self.assertEqual(chunk_ranges(10, 4), [(0, 4), (4, 4), (8, 2)])
        self.assertEqual(chunk_ranges(8, 4), [(0, 4), (4, 4)])
        self.assertEqual(chunk_ranges(0, 4), [])
        self.assertEqual(chunk_ranges(5, 16 << 20), [(0, 5)])

    def test_chunks_reassemble_the_tensor(self):
        w = to_wire("x", torch.randn(37, 5).to(torch.bfloat16))
        out = bytearray(w.num_bytes)
        for offset, length in chunk_ranges(w.num_bytes, 7):  # splits 2-byte elements
            out[offset:offset + length] = w.data[offset:offset + length]
        self.assertEqual(bytes(out), bytes(w.data))

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            chunk_ranges(10, 0)
        with self.assertRaises(ValueError):
            chunk_ranges(-1, 4)


if __name__ == "__main__":
    unittest.main()
