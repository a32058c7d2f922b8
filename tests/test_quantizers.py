"""Per-method properties of the quantizers (fp16/bf16, qsgd, terngrad, natural, u8bit,
inceptionn, sketch), beyond the generic contract: the values each may decode to, the exact
bytes on the wire, the promises their papers make (QSGD's variance bound, natural compression's
powers of two, INCEPTIONN's error bound, ...) and the rejection of bad parameters."""

import math

import numpy as np
import pytest
import tensorflow as tf
import torch

from grace_dl.backend import ops_for
from grace_dl.compressors.base import Call
from grace_dl.compressors.binning import bucketize
from grace_dl.compressors.fp16 import BF16Compressor, FP16Compressor
from grace_dl.compressors.inceptionn import InceptionnCompressor
from grace_dl.compressors.natural import NaturalCompressor
from grace_dl.compressors.qsgd import QSGDCompressor
from grace_dl.compressors.sketch import SketchCompressor
from grace_dl.compressors.terngrad import TernGradCompressor
from grace_dl.compressors.u8bit import U8bitCompressor, dynamic_tree
from grace_dl.state import config_of

FRAMEWORKS = ["torch", "tf"]


def to_fw(arr, fw, dtype="float32"):
    if fw == "torch":
        return torch.from_numpy(np.array(arr, np.float32)).to(getattr(torch, dtype))
    return tf.cast(tf.constant(np.array(arr, np.float32)), dtype)


def to_np(t):
    return np.asarray(ops_for(t).to_numpy(t), np.float64)


def run(comp, x, fw="torch", name="w", dtype="float32", rank=0):
    payload, ctx = comp.compress(to_fw(x, fw, dtype), name, Call(rank=rank))
    return payload, to_np(comp.decompress(payload, ctx))


def nbytes(payload):
    return sum(int(ops_for(p).nbytes(p)) for p in payload)


def gaussian(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# ------------------------------------------------------------------ fp16 / bf16
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("cls,wire", [(FP16Compressor, "float16"), (BF16Compressor, "bfloat16")])
def test_half_is_a_cast_and_sums_on_the_wire(cls, wire, fw):
    x, y = gaussian(300, 1), gaussian(300, 2)
    comp = cls()
    (px,), ctx = comp.compress(to_fw(x, fw), "a")
    (py,), _ = comp.compress(to_fw(y, fw), "b")
    assert ops_for(px).dtype(px) == wire and nbytes([px]) == 2 * x.size
    expected = to_np(to_fw(to_np(to_fw(x, fw, wire)), fw))
    np.testing.assert_array_equal(to_np(comp.decompress([px], ctx)), expected)
    # allreduce_safe: the sum of the 16-bit payloads decodes to (about) the sum.
    total = to_np(comp.decompress([px + py], ctx))
    eps = 2.0**-8 if wire == "float16" else 2.0**-6
    np.testing.assert_allclose(total, x + y, rtol=eps, atol=eps * 4)
    assert not cls.caps.unbiased
    assert cls.caps.allreduce_safe == (wire == "float16")  # Horovod 0.28.1 cannot sum bf16


def test_bf16_is_refused_over_allreduce_and_widened_sums_are_counted_wide():
    """bf16 over allreduce would be summed as fp32 (32 bits on the wire for a 16-bit method), so
    the pair is refused; a bf16 gradient sent uncompressed is summed as fp32 and counted so."""
    from grace_dl import grace_from_params
    from grace_dl.tensorflow.collectives import TFCollectives
    from grace_dl.torch.collectives import TorchCollectives

    with pytest.raises(ValueError, match="'bf16'.*'allgather'"):
        grace_from_params({"compressor": "bf16", "communicator": "allreduce"})
    grace_from_params({"compressor": "bf16", "communicator": "allgather"})
    for dtype, nbytes_ in [("bfloat16", 40), ("float16", 20), ("float32", 40), ("int8", 40),
                           ("float64", 80)]:
        assert TorchCollectives().allreduce_nbytes(
            torch.zeros(10, dtype=getattr(torch, dtype))) == nbytes_, dtype
        assert int(TFCollectives().allreduce_nbytes(tf.zeros(10, dtype))) == nbytes_, dtype


# ------------------------------------------------------------------ qsgd
@pytest.mark.parametrize("s,bits", [(1, 2), (3, 3), (7, 4), (15, 5), (127, 8)])
def test_qsgd_bytes_and_levels(s, bits):
    n, b = 1001, 100
    x = gaussian(n, 3)
    comp = QSGDCompressor(quantum_num=s, bucket_size=b)
    payload, out = run(comp, x)
    assert nbytes(payload) == math.ceil(n * bits / 8) + 4 * math.ceil(n / b)
    assert comp.payload_nbytes(n) == nbytes(payload)
    norms = np.array([np.linalg.norm(x[i:i + b].astype(np.float64)) for i in range(0, n, b)])
    levels = out / np.repeat(norms / s, b)[:n]
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
    assert np.abs(levels).max() <= s + 1e-4
    # Each level is one of the two neighbours of s * v / ||v|| (the stochastic rounding).
    exact = x / np.repeat(norms / s, b)[:n]
    assert np.all((np.round(levels) == np.floor(exact)) | (np.round(levels) == np.ceil(exact)))


def test_qsgd_buckets_are_independent_and_zero_buckets_exact():
    b = 64
    x = np.concatenate([gaussian(b, 4, 1e4), np.zeros(b), gaussian(b, 5, 1e-3)]).astype(np.float32)
    _, out = run(QSGDCompressor(quantum_num=7, bucket_size=b), x)
    assert np.all(out[b:2 * b] == 0)
    small = x[2 * b:]
    # The small bucket is quantized against its own norm, not the huge one's.
    assert np.abs(out[2 * b:] - small).max() <= np.linalg.norm(small) / 7 * 1.0001


def test_qsgd_variance_bound_lemma_3_1():
    b, s = 256, 2
    x = gaussian(4 * b, 6)
    comp = QSGDCompressor(quantum_num=s, bucket_size=b)
    draws = np.stack([run(comp, x)[1] for _ in range(300)])
    err = ((draws - x) ** 2).reshape(300, 4, b).sum(-1).mean(0)
    bound = min(b / s**2, math.sqrt(b) / s) * (x.reshape(4, b).astype(np.float64) ** 2).sum(-1)
    assert np.all(err <= bound)
    assert np.all(err > 0)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_qsgd_nan_poisons_only_its_bucket(fw):
    x = gaussian(300, 7)
    x[130] = np.nan
    _, out = run(QSGDCompressor(bucket_size=100), x, fw)
    assert np.isnan(out[100:200]).all()
    assert np.isfinite(out[:100]).all() and np.isfinite(out[200:]).all()


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("big", [1e20, -3e25, 3e37])
def test_qsgd_large_finite_value_keeps_its_bucket_finite(fw, big):
    # Its square overflows float32: the bucket norm must not.
    x = gaussian(300, 7)
    x[130] = big
    payload, out = run(QSGDCompressor(bucket_size=100), x, fw)
    assert np.isfinite(out).all()
    assert out[130] == pytest.approx(big, rel=1e-5)
    exact = np.linalg.norm(x[100:200].astype(np.float64))
    assert to_np(payload[1])[1] == pytest.approx(exact, rel=1e-5)
    same, _ = run(QSGDCompressor(bucket_size=100), gaussian(300, 7), fw)
    assert to_np(payload[1])[[0, 2]] == pytest.approx(to_np(same[1])[[0, 2]], rel=1e-6)


def test_qsgd_draws_are_keyed_by_seed_name_and_step():
    x = gaussian(500, 8)
    first = run(QSGDCompressor(quantum_num=3, seed=1), x)[1]
    assert np.array_equal(first, run(QSGDCompressor(quantum_num=3, seed=1), x)[1])
    assert not np.array_equal(first, run(QSGDCompressor(quantum_num=3, seed=2), x)[1])
    assert not np.array_equal(first, run(QSGDCompressor(quantum_num=3, seed=1), x, name="v")[1])
    comp = QSGDCompressor(quantum_num=3, seed=1)
    run(comp, x)
    assert not np.array_equal(first, run(comp, x)[1])  # step 2 draws afresh


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("cls", [QSGDCompressor, TernGradCompressor, NaturalCompressor])
def test_dither_is_independent_across_ranks(cls, fw):
    """Eight ranks quantizing the same tensor at the same step draw independent dither, so the
    mean of their decompressed tensors is ~8x closer to the input than one rank's (with shared
    dither all eight would decode identically). The rank is not configuration: it reaches
    ``compress`` as its ``Call`` argument and stays out of ``config()``."""
    x = gaussian(4096, 11)
    outs = []
    for rank in range(8):
        comp = cls()
        outs.append(run(comp, x, fw, rank=rank)[1])
        assert config_of(comp) == config_of(cls())
    assert not np.array_equal(outs[0], outs[1])
    one = ((outs[0] - x) ** 2).sum()
    mean = ((np.mean(outs, axis=0) - x) ** 2).sum()
    assert mean < 0.3 * one


@pytest.mark.parametrize("bits", [8, 16])
def test_dither_grid_and_bias_bound(bits):
    """``seeding.dither`` (``ops.dither``): integers on the stated grid, the same in torch and TF,
    keyed by (seed, name, step, stream), uniform; and the stated bias bound of a rounding
    ``floor(t + (k + 1/2) / 2**bits)``: ``|E - t| <= 2**-(bits + 1)``. The expectation is taken
    exactly, over every grid point, through the quantizers' own float32 path (``add_dither``)."""
    from grace_dl import seeding
    from grace_dl.compressors.flat import add_dither
    from grace_dl.tensorflow import ops as tf_ops
    from grace_dl.torch import ops as torch_ops

    n = 1 << 18
    k = seeding.dither(3, "w", 5, n, bits, stream=2)
    assert k.dtype == (np.uint8 if bits == 8 else np.uint16) and k.shape == (n,)
    np.testing.assert_array_equal(torch_ops.dither(3, "w", 5, n, bits, stream=2).numpy(), k)
    np.testing.assert_array_equal(tf_ops.dither(3, "w", 5, n, bits, stream=2).numpy(), k)
    np.testing.assert_array_equal(seeding.dither(3, "w", 5, 1001, bits, stream=2), k[:1001])
    for other in [(4, "w", 5, 2), (3, "v", 5, 2), (3, "w", 6, 2), (3, "w", 5, 1)]:
        assert not np.array_equal(seeding.dither(other[0], other[1], other[2], 64, bits,
                                                 stream=other[3]), k[:64])
    # Uniform over the grid: 16 equal bins of the top bits hold n/16 each within 5 sigma.
    counts = np.bincount(k.astype(np.int64) >> (bits - 4), minlength=16)
    assert np.abs(counts - n / 16).max() < 5 * np.sqrt(n / 16)
    with pytest.raises(ValueError, match="bits must be one of"):
        seeding.dither(0, "w", 1, 8, 12)

    # Exact expectation over the whole grid, for t across [-3, 3] and near integers.
    grid = torch.arange(1 << bits, dtype=torch.int32).to(torch.uint8 if bits == 8 else torch.uint16)
    t = np.concatenate([np.random.default_rng(0).uniform(-3, 3, 300),
                        [0.0, 1.0, -2.0, 2.0**-(bits + 2), 1 - 2.0**-(bits + 2), 0.5, -0.25]])
    bound = 2.0**-(bits + 1)
    for value in t.astype(np.float32):
        rounded = torch.floor(add_dither(torch_ops, torch.full((1 << bits,), value), grid, bits))
        expected = rounded.double().mean().item()
        assert abs(expected - float(value)) <= bound + 2.0**-21, (value, expected)
        frac = float(value) - math.floor(value)
        if frac < bound or frac > 1 - bound:  # within half a grid step: deterministic
            assert rounded.unique().numel() == 1


def test_quantizers_mean_is_within_the_stated_bias_bound():
    """Many draws of qsgd (8-bit dither), terngrad and natural (16 bits) average to x within
    5 standard errors (from each method's variance bound) plus the docstrings' bias bounds."""
    x = gaussian(256, 21)
    x[:3] = [0.0, 1e-7, -3e-6]  # elements far below one step: the dither's grid matters most
    a, m, norm = np.abs(x).astype(np.float64), np.abs(x).max(), np.linalg.norm(x.astype(np.float64))
    cases = [  # (compressor, bias bound, a bound on each element's standard deviation)
        (QSGDCompressor(bucket_size=256), norm / (127 * 512), norm / 127 / 2),
        (TernGradCompressor(), m / 2.0**17, np.sqrt(a * m)),
        (NaturalCompressor(), a * 2.0**-17, a / np.sqrt(8)),
    ]
    draws_n = 1500
    for comp, bound, sd in cases:
        draws = np.stack([run(comp, x, rank=r)[1] for r in range(draws_n)])
        err = np.abs(draws.mean(0) - x)
        assert np.all(err <= 5 * sd / np.sqrt(draws_n) + bound + 1e-12), type(comp).__name__
        assert err[0] == 0.0


def test_randomk_positions_do_not_depend_on_the_rank():
    from grace_dl.compressors.randomk import RandomKCompressor

    x = gaussian(1000, 12)
    picks = []
    for rank in range(3):
        comp = RandomKCompressor(compress_ratio=0.05)
        picks.append(np.flatnonzero(run(comp, x, rank=rank)[1]))
    assert all(np.array_equal(picks[0], p) for p in picks[1:])


@pytest.mark.parametrize("kwargs,match", [
    ({"quantum_num": 0}, "quantum_num must be in \\[1, 127\\], got 0"),
    ({"quantum_num": 128}, "quantum_num must be in \\[1, 127\\], got 128"),
    ({"quantum_num": 2.5}, "quantum_num must be an integer, got 2.5"),
    ({"quantum_num": "many"}, "quantum_num must be an integer \\(not str\\), got 'many'"),
    ({"bucket_size": 0}, "bucket_size must be in \\[1, inf\\], got 0"),
])
def test_qsgd_rejects_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QSGDCompressor(**kwargs)


# ------------------------------------------------------------------ terngrad
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_terngrad_is_ternary_with_the_max_scaler(fw):
    x = gaussian(1003, 9)
    payload, out = run(TernGradCompressor(), x, fw)
    m = np.abs(x).max()
    assert set(np.unique(out)) <= {-m, 0.0, m}
    assert nbytes(payload) == math.ceil(1003 / 4) + 4 == TernGradCompressor().payload_nbytes(1003)
    nz = out != 0
    assert np.all(np.sign(out[nz]) == np.sign(x[nz]))
    assert out[np.argmax(np.abs(x))] == x[np.argmax(np.abs(x))]  # probability 1


# ------------------------------------------------------------------ natural
def _is_power_of_two(v):
    m, _ = np.frexp(np.abs(v))
    return m == 0.5


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_natural_rounds_to_a_neighbouring_power_of_two(fw):
    x = gaussian(2000, 10) * np.exp(np.random.default_rng(1).uniform(-20, 20, 2000))
    x = x.astype(np.float32)
    x[:4] = [0.5, -8.0, 0.0, 2.0**-60]
    payload, out = run(NaturalCompressor(), x, fw)
    assert nbytes(payload) == 2000 + 4 == NaturalCompressor().payload_nbytes(2000)
    assert ops_for(payload[0]).dtype(payload[0]) == "uint8"
    np.testing.assert_array_equal(out[:4], x[:4])  # powers of two (and 0) are kept
    lo = 2.0 ** np.floor(np.log2(np.abs(x[4:].astype(np.float64))))
    assert np.all((np.abs(out[4:]) == lo) | (np.abs(out[4:]) == 2 * lo))
    assert np.all(np.sign(out) == np.sign(x))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_natural_is_unbiased_below_the_clipped_window(fw):
    # With 1.0 the largest, the window's 125 binades reach down to 2^-123: 1e-39 (a subnormal)
    # and -3e-38 lie below and must go to 0 or to +-2^-123 with the probabilities that keep
    # the mean, in TF too (which flushes subnormal floats to zero).
    x = np.array([1.0, 1e-39, -3e-38, 0.75], np.float32)
    comp = NaturalCompressor()
    draws = np.stack([run(comp, x, fw)[1] for _ in range(4000 if fw == "torch" else 1500)])
    assert set(np.unique(np.abs(draws[:, 1]))) == {0.0, 2.0**-123}
    mean, se = draws.mean(0), draws.std(0, ddof=1) / np.sqrt(len(draws))
    assert np.all(np.abs(mean - x) <= 5 * se + 1e-12 * np.abs(x))
    # Variance bound of the paper: E (C(v) - v)^2 <= v^2 / 8.
    assert ((draws[:, 3] - 0.75) ** 2).mean() <= 0.75**2 / 8 * 1.1


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_natural_keeps_nan_and_signed_inf(fw):
    x = gaussian(50, 11)
    x[[3, 7, 9]] = [np.nan, np.inf, -np.inf]
    _, out = run(NaturalCompressor(), x, fw)
    assert np.isnan(out[3]) and out[7] == np.inf and out[9] == -np.inf
    assert np.isfinite(np.delete(out, [3, 7, 9])).all()


# ------------------------------------------------------------------ u8bit
def test_dynamic_tree_table():
    table = dynamic_tree()
    assert table.shape == (128,) and table[0] == 0 and table[-1] == 1
    assert np.all(np.diff(table) > 0)
    assert np.isclose(table[1], 1e-6)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_u8bit_rounds_to_the_nearest_dictionary_value(fw):
    x = gaussian(700, 12) * np.exp(np.random.default_rng(2).uniform(-14, 0, 700))
    x = x.astype(np.float32)
    payload, out = run(U8bitCompressor(), x, fw)
    assert nbytes(payload) == 704 == U8bitCompressor().payload_nbytes(700)
    m = np.abs(x).max()
    values = dynamic_tree().astype(np.float64) * m
    nearest = values[np.abs(np.abs(x)[:, None] - values[None, :]).argmin(1)] * np.sign(x)
    np.testing.assert_allclose(out, nearest, rtol=1e-6, atol=1e-12)
    assert out[np.argmax(np.abs(x))] == x[np.argmax(np.abs(x))]
    np.testing.assert_array_equal(out, run(U8bitCompressor(), x, fw)[1])  # deterministic


# ------------------------------------------------------------------ inceptionn
@pytest.mark.parametrize("error_bound", [2.0**-10, 1e-3, 3e-6])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_inceptionn_error_bound_and_bytes(fw, error_bound):
    rng = np.random.default_rng(13)
    x = (rng.standard_normal(5000) * np.exp(rng.uniform(-16, 6, 5000))).astype(np.float32)
    comp = InceptionnCompressor(error_bound=error_bound)
    payload, out = run(comp, x, fw)
    assert np.abs(out - x).max() <= error_bound
    d = 2.0 ** math.floor(math.log2(error_bound))
    q = np.abs(x.astype(np.float64)) / d
    n1 = ((q >= 1) & (q < 2**7)).sum()
    n2 = ((q >= 2**7) & (q < 2**15)).sum()
    n3 = (q >= 2**15).sum()
    assert min(n1, n2, n3) > 0
    assert [tuple(p.shape) for p in payload] == [(1250,), (n1,), (n2,), (n3,)]
    assert nbytes(payload) == 1250 + n1 + 2 * n2 + 4 * n3
    assert np.all(out[q < 1] == 0)
    np.testing.assert_array_equal(out[q >= 2**15], x[q >= 2**15])


def test_inceptionn_raw_values_keep_the_input_dtype():
    x = np.array([1e5, 1e-300, 1.0 + 2**-40, 0.3], np.float64)
    comp = InceptionnCompressor()
    payload, ctx = comp.compress(torch.from_numpy(x), "w")
    out = comp.decompress(payload, ctx)
    assert out.dtype == torch.float64 and payload[3].dtype == torch.float64
    assert out[0].item() == 1e5 and out[1].item() == 0.0
    assert abs(out[2].item() - x[2]) <= 2.0**-10 and abs(out[3].item() - 0.3) <= 2.0**-10


@pytest.mark.parametrize("bad", [0, -1e-3, 2.0, float("nan"), "tiny"])
def test_inceptionn_rejects_bad_error_bound(bad):
    with pytest.raises(ValueError, match="error_bound must be"):
        InceptionnCompressor(error_bound=bad)


# ------------------------------------------------------------------ sketch
@pytest.mark.parametrize("q,bits", [(2, 1), (16, 4), (64, 6), (100, 7), (256, 8)])
def test_sketch_buckets_bytes_monotone_and_sum(q, bits):
    x = gaussian(3001, 14)
    comp = SketchCompressor(quantiles=q)
    payload, out = run(comp, x)
    assert nbytes(payload) == math.ceil(3001 * bits / 8) + 4 * q == comp.payload_nbytes(3001)
    assert len(np.unique(out)) <= q
    order = np.argsort(x, kind="stable")
    assert np.all(np.diff(out[order]) >= 0)  # larger inputs never decode smaller
    np.testing.assert_allclose(out.sum(), x.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)
    # Buckets hold about n/q elements each (quantiles of the values themselves).
    _, counts = np.unique(out, return_counts=True)
    assert counts.max() <= 2 * 3001 / q + 2


def test_sketch_samples_large_tensors_alike_in_torch_and_tf():
    x = gaussian(5000, 15)
    comp = {fw: SketchCompressor(quantiles=16, sample_size=1000, seed=4) for fw in FRAMEWORKS}
    outs = {fw: run(c, x, fw)[1] for fw, c in comp.items()}
    np.testing.assert_allclose(outs["torch"], outs["tf"], rtol=1e-5, atol=1e-6)
    _, counts = np.unique(outs["torch"], return_counts=True)
    assert len(counts) == 16 and counts.min() > 5000 / 16 / 2


@pytest.mark.parametrize("kwargs", [{"quantiles": 1}, {"quantiles": 257}, {"sample_size": 1}])
def test_sketch_rejects_bad_parameters(kwargs):
    (key, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{key} must be in .* got {value}"):
        SketchCompressor(**kwargs)


@pytest.mark.parametrize("case", ["quantiles", "repeated_zero_edges", "close_edges"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_cell_bucketize_matches_a_binary_search(fw, case):
    rng = np.random.default_rng(16)
    x = (rng.standard_normal(5000) * np.exp(rng.uniform(-30, 5, 5000))).astype(np.float32)
    x[:10] = [0.0, -0.0, 1e-39, -1e-39, np.inf, -np.inf, 1e-45, -1e-45, 3.0, -3.0]
    edges = {"quantiles": np.quantile(x[10:], np.arange(1, 64) / 64),
             "repeated_zero_edges": np.r_[rng.choice(x[10:], 20), 0.0, 0.0, -0.0],
             "close_edges": [1.0, 1.0000001]}[case]  # one cell, two edges: binary search path
    edges = np.sort(np.asarray(edges, np.float32))
    expected = np.searchsorted(edges.astype(np.float64), x.astype(np.float64), side="right")
    ops = ops_for(to_fw(x, fw))
    got = ops.to_numpy(bucketize(ops, to_fw(x, fw), to_fw(edges, fw)))
    np.testing.assert_array_equal(got, expected)
