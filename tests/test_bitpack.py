"""Bit packing of sub-byte codes into uint8, torch and TF, every width 1..8, odd lengths."""

import numpy as np
import pytest
import tensorflow as tf
import torch

from grace_dl.tensorflow import ops as tf_ops
from grace_dl.torch import ops as torch_ops

LENGTHS = [0, 1, 3, 7, 8, 9, 13, 1001]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", LENGTHS)
def test_round_trip_and_size(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 2**bits, size=n, dtype=np.uint8)
    packed_t = torch_ops.pack_bits(torch.from_numpy(codes), bits)
    packed_f = tf_ops.pack_bits(tf.constant(codes), bits)
    expected_bytes = -(-n * bits // 8)
    assert packed_t.dtype == torch.uint8 and packed_f.dtype == tf.uint8
    assert packed_t.numel() == expected_bytes == torch_ops.packed_size(n, bits)
    # One wire format: torch and TF produce the same bytes.
    np.testing.assert_array_equal(packed_t.numpy(), packed_f.numpy())
    np.testing.assert_array_equal(torch_ops.unpack_bits(packed_t, bits, n).numpy(), codes)
    np.testing.assert_array_equal(tf_ops.unpack_bits(packed_f, bits, n).numpy(), codes)


def test_layout_is_little_endian_within_a_byte():
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert torch_ops.pack_bits(codes, 1).tolist() == [0b10000001]
    assert torch_ops.pack_bits(torch.tensor([3, 0, 2, 1], dtype=torch.uint8), 2).tolist() == [
        0b01100011]


def test_pack_inside_tf_function():
    codes = np.arange(37, dtype=np.uint8) % 8

    @tf.function
    def round_trip(c):
        return tf_ops.unpack_bits(tf_ops.pack_bits(c, 3), 3, 37)

    np.testing.assert_array_equal(round_trip(tf.constant(codes)).numpy(), codes)


@pytest.mark.parametrize("ops", [torch_ops, tf_ops], ids=["torch", "tf"])
@pytest.mark.parametrize("bits", [0, 9])
def test_bad_width_is_rejected(ops, bits):
    codes = np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        ops.pack_bits(ops.from_numpy(codes), bits)
