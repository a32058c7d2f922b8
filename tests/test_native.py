"""The compiled kernels (grace_dl/native): built by the project's install, and equal to their
NumPy twins on every SIMD path this CPU has, edge values and buffer overflow included."""

import numpy as np
import pytest
import torch

from grace_dl import native
from grace_dl.compressors.paths import Paths, own
from grace_dl.native.paths import COMPILED
from grace_dl.torch import ops


@pytest.fixture
def every_path():
    """The SIMD widths this CPU runs (512 / 256 / scalar, as far as it has them); the default
    is restored afterwards."""
    paths = sorted({native.vector_bits(), 256 if native.vector_bits() >= 256 else 0, 0},
                   reverse=True)
    yield paths
    native.limit_vector_bits(512)


def test_the_install_built_the_library():
    """`pip install -e .` (scripts/setup.sh) compiles kernels.c here: a silent fallback to the
    NumPy twins would cost the sparsifiers their fast scan."""
    assert native.available()
    assert native.vector_bits() in (0, 256, 512)


def _mixed(n, seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 2).astype(np.float32)
    if n > 40:
        a[[0, 17, 33]] = [np.nan, np.inf, -np.inf]
        a[5] = -0.0
        a[21] = 1.5                # exactly at the threshold below
        a[22] = -1.5
    return a


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100, 3 * (1 << 16) + 123])
@pytest.mark.parametrize("sign", [None, 1, -1])
@pytest.mark.parametrize("thr", [1.5, 0.0, -1.0, float("inf"), float("nan"), 3.9])
def test_positions_equal_the_numpy_twin_on_every_path(every_path, n, sign, thr):
    a = _mixed(n, n)
    mag = np.abs(a) if sign is None else (a if sign > 0 else -a)
    expected = np.flatnonzero(mag >= np.float32(thr))
    for bits in every_path:
        native.limit_vector_bits(bits)
        assert native.vector_bits() == bits
        got = native.positions_at_least(a, thr, sign)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected, err_msg=f"path {bits}")
    np.testing.assert_array_equal(ops._positions_numpy(a, thr, sign), expected)


def test_more_positions_than_the_first_buffer_holds(every_path):
    """The first call's buffer holds n/64 positions: a low threshold overflows it and the
    kernel runs again with room for all (the count is exact either way)."""
    a = _mixed(200_000, 3)
    for bits in every_path:
        native.limit_vector_bits(bits)
        got = native.positions_at_least(a, 0.5)
        np.testing.assert_array_equal(got, np.flatnonzero(np.abs(a) >= 0.5))
        assert got.size > 200_000 // 64


def test_other_dtypes_and_strided_arrays_take_the_twin():
    """The kernel declines them; the CPU path's selection gives them to the framework's ops
    (NumPy chunk by chunk for float64), with the same positions."""
    a = _mixed(5000, 4)
    for x in (a.astype(np.float64), a[::2], a.astype(np.float16)):
        want = np.flatnonzero(np.abs(x) >= x.dtype.type(1.5))
        assert native.positions_at_least(x, 1.5) is None
        np.testing.assert_array_equal(ops._positions_numpy(x, 1.5), want)
        got = COMPILED.at_least(ops, torch.from_numpy(np.ascontiguousarray(x)), 1.5)
        np.testing.assert_array_equal(got.numpy(), want)


def test_cpu_selection_scans_a_tensor_view_with_the_kernel(monkeypatch):
    """The CPU path's scan passes the tensor's own buffer (a slice of a larger one here) to
    the kernel, and gives the framework's positions."""
    base = torch.from_numpy(_mixed(10_000, 5))
    view = base[1000:9000]
    scans = []
    kernel = native.positions_at_least
    monkeypatch.setattr(native, "positions_at_least",
                        lambda a, *args: scans.append(a) or kernel(a, *args))
    got = COMPILED.at_least(ops, view, torch.tensor(1.5), -1)
    assert len(scans) == 1 and scans[0].ctypes.data == view.data_ptr()
    np.testing.assert_array_equal(got.numpy(), np.flatnonzero((view <= -1.5).numpy()))
    np.testing.assert_array_equal(ops.positions_at_least(view, torch.tensor(1.5), -1).numpy(),
                                  got.numpy())


def _planes(a):
    return (np.packbits(a < 0, bitorder="little"), np.packbits(a == 0, bitorder="little"))


SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 100, 3 * (1 << 16) + 123]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bad", [None, np.nan, np.inf, -np.inf])
def test_sign_planes_equal_the_framework_code_on_every_path(every_path, n, bad):
    """The planes and status byte signsgd sends, sign(x) and x - sign(x), bit for bit (the sign
    of zero included: torch.sign gives +0, so -0 leaves an error of -0)."""
    from grace_dl.compressors import signbits
    from grace_dl.torch import ops

    a = _mixed(n, n + 1)
    a[~np.isfinite(a)] = 1.0
    if bad is not None and n:
        a[n // 2] = bad
    t = torch.from_numpy(a)
    want_dec = torch.sign(t)
    want_err = t - want_dec
    neg, zero = _planes(a)
    want = np.concatenate([neg, zero, signbits.status(ops, t).numpy()])
    for bits in every_path:
        native.limit_vector_bits(bits)
        err, dec = np.full(n, 7, np.float32), np.full(n, 7, np.float32)
        got = native.sign_planes(a, err, dec)
        np.testing.assert_array_equal(got, want, err_msg=f"path {bits}")
        assert got[-1] == (bad is not None and n > 0)
        np.testing.assert_array_equal(dec.view(np.uint32), want_dec.numpy().view(np.uint32))
        np.testing.assert_array_equal(err.view(np.uint32), want_err.numpy().view(np.uint32))
        np.testing.assert_array_equal(native.sign_planes(a), want)


@pytest.mark.parametrize("n", SIZES)
def test_ternary_equals_the_table_on_every_path(every_path, n):
    rng = np.random.default_rng(n)
    nb = -(-n // 8)
    pos, neg = (rng.integers(0, 256, nb, dtype=np.uint8) for _ in range(2))
    p = np.unpackbits(pos, count=n, bitorder="little").astype(np.int8)
    m = np.unpackbits(neg, count=n, bitorder="little").astype(np.int8)
    want = (p - m).astype(np.float32)      # both bits set: 0, as signbits' table
    for bits in every_path:
        native.limit_vector_bits(bits)
        out = np.full(n, 7, np.float32)
        assert native.ternary(pos, neg, n, out) is out
        np.testing.assert_array_equal(out, want, err_msg=f"path {bits}")


def test_sign_kernels_refuse_what_they_do_not_take():
    a = _mixed(64, 2)
    assert native.sign_planes(a.astype(np.float64)) is None
    assert native.sign_planes(a[::2]) is None
    assert native.sign_planes(a, err=np.empty(63, np.float32)) is None
    assert native.sign_planes(a, dec=np.empty(64, np.float64)) is None
    pos = np.zeros(8, np.uint8)
    assert native.ternary(pos, pos, 64, np.empty(64, np.float64)) is None
    assert native.ternary(pos, pos[:7], 64, np.empty(64, np.float32)) is None


def test_signsgd_through_torch_takes_the_kernel_and_matches_tensorflow():
    """The same payload and decoded vote from torch (compiled) and TF (framework ops)."""
    tf = pytest.importorskip("tensorflow")
    from grace_dl.compressors.signsgd import SignSGDCompressor

    c = SignSGDCompressor()
    a = _mixed(1001, 9)
    a[0] = 1.0                                   # no NaN/Inf: the vote decodes
    a[[17, 33]] = [3.0, -3.0]
    p_torch, ctx_t = c.compress(torch.from_numpy(a), "g")
    p_tf, ctx_f = c.compress(tf.constant(a), "g")
    np.testing.assert_array_equal(p_torch[0].numpy(), p_tf[0].numpy())
    b = _mixed(1001, 10)
    b[[0, 17, 33]] = [1.0, 2.0, 2.0]
    q_torch, _ = c.compress(torch.from_numpy(b), "g")
    q_tf, _ = c.compress(tf.constant(b), "g")
    vote_t = own(c).combine([p_torch, q_torch], ctx_t)
    vote_f = own(c).combine([p_tf, q_tf], ctx_f)
    np.testing.assert_array_equal(vote_t.numpy(), vote_f.numpy())
    assert set(np.unique(vote_t.numpy())) <= {-1.0, 0.0, 1.0}


def _qsgd_everything(c, x, monkeypatch=None):
    """Payload, error and decoded values, decode and 2-rank combine of qsgd on ``x``, through
    ``c`` (a compressor: the reference; or its CPU path)."""
    from grace_dl.compressors.base import LOCAL, Compressor

    n = x.numel()
    err, dec = torch.empty(n), torch.empty(n)
    path = own(c) if isinstance(c, Compressor) else c
    payload, ctx = c.compress(x, "g", LOCAL)
    got = path.compress_with_error(x, "g", LOCAL, err, dec)
    other, _ = c.compress(x.flip(0).contiguous(), "h", LOCAL)
    out = torch.full((n,), 7.0)
    return ([t.clone() for t in payload] + [t.clone() for t in got[0]] + [err, dec]
            + [path.decompress_into(payload, ctx, out).clone(),
               path.combine([payload, other], ctx)])


@pytest.mark.parametrize("quantum_num,bucket_size", [(64, 512), (127, 100), (7, 512), (63, 33)])
def test_qsgd_kernels_give_the_torch_code_bits_on_every_path(every_path, monkeypatch,
                                                             quantum_num, bucket_size):
    """Levels (8- and 16-bit dither), error, decoded values, decoding and combining: bit for
    bit what torch's elementwise ops give, NaN and Inf buckets, rows of any length and the
    short last bucket included."""
    from grace_dl.compressors.qsgd import QSGDCompressor

    x = torch.from_numpy(_mixed(5 * bucket_size + 37, quantum_num))   # NaN, +-Inf in bucket 0
    x[3 * bucket_size + 1] = 1e30                                     # a huge finite value
    calls = []
    for name in ("qsgd_levels", "qsgd_values"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _real=real, _name=name, **k:
                            calls.append(_name) or _real(*a, **k))
    results = {}
    for bits in every_path:
        native.limit_vector_bits(bits)
        results[bits] = _qsgd_everything(Paths(QSGDCompressor(quantum_num, bucket_size)).on(x),
                                         x)
    assert {"qsgd_levels", "qsgd_values"} <= set(calls)     # the kernels did run
    want = _qsgd_everything(QSGDCompressor(quantum_num, bucket_size), x)    # the reference
    for bits, got in results.items():
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.dtype == w.dtype, (bits, i)
            np.testing.assert_array_equal(g.numpy().view(np.uint8), w.numpy().view(np.uint8),
                                          err_msg=f"path {bits}, output {i}")


def test_qsgd_error_may_overwrite_its_input(every_path):
    """``err`` may be ``x``'s own memory (a memory's slot): each element is read first."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    k = rng.integers(0, 256, x.shape, dtype=np.uint8)
    norms = np.linalg.norm(x, axis=1).astype(np.float32)
    scale, step = (np.float32(64) / norms).astype(np.float32), (norms / np.float32(64))
    for bits in every_path:
        native.limit_vector_bits(bits)
        err = np.empty_like(x)
        codes = native.qsgd_levels(x, scale, step, k, 64.0, 128, err)
        inplace = x.copy()
        np.testing.assert_array_equal(native.qsgd_levels(inplace, scale, step, k, 64.0, 128,
                                                         inplace), codes)
        np.testing.assert_array_equal(inplace, err)


def test_the_cpu_path_leaves_what_numpy_cannot_hold_to_the_reference():
    """bfloat16 has no NumPy dtype: the CPU path's signsgd runs the reference there."""
    from grace_dl.compressors.base import LOCAL
    from grace_dl.compressors.signsgd import SignSGDCompressor

    x = torch.randn(100).to(torch.bfloat16)
    path = Paths(SignSGDCompressor()).on(x)
    assert type(path).__name__ == "SignSGDOnCpu"
    payload, ctx = path.compress(x, "g", LOCAL)
    assert torch.equal(path.decompress(payload, ctx), torch.sign(x))


def test_use_false_gives_every_kernel_to_its_twin():
    """``native.use(False)`` (what the benchmarks' ``-twins`` variants do between steps): the
    kernels step aside, the results stay the same, and True brings them back."""
    from benchmarks.pipelines import kernels_on, make_grace
    from grace_dl.compressors.signsgd import SignSGDCompressor

    a = _mixed(1000, 11)
    want = native.positions_at_least(a, 1.5)
    payload = SignSGDCompressor().compress(torch.from_numpy(a), "g")[0][0]
    try:
        native.use(False)
        assert not native.in_use()
        assert native.sign_planes(a) is None
        assert native.ternary(np.zeros(125, np.uint8), np.zeros(125, np.uint8), 1000,
                              np.empty(1000, np.float32)) is None
        assert native.positions_at_least(a, 1.5) is None
        np.testing.assert_array_equal(COMPILED.at_least(ops, torch.from_numpy(a), 1.5), want)
        assert native.sfc64_seed([1, 2, 3, 4]) is None
        assert native.choice_sorted(np.zeros(4, np.uint64), 100, 3, False) is None
        assert native.top_positions(a, 3) is None
        assert native.sparse_sum(np.zeros(4, np.float32), [np.arange(2, dtype=np.int32)],
                                 [np.ones(2, np.float32)]) is None
        np.testing.assert_array_equal(
            SignSGDCompressor().compress(torch.from_numpy(a), "g")[0][0].numpy(),
            payload.numpy())
    finally:
        native.use(True)
    assert native.in_use() and native.sign_planes(a) is not None
    assert kernels_on("topk") and kernels_on("topk-bucket") and not kernels_on("topk-twins")
    grc, options = make_grace("qsgd-2phase-twins", torch.nn.Linear(2, 2))
    assert options == {} and grc.compressor.quantum_num == 64
    grc, options = make_grace("randomk-fused", torch.nn.Linear(2, 2))
    assert options == {"groups": 1} and grc.compressor.compress_ratio == 0.01


@pytest.mark.parametrize("thr", [1.5, 2.576, 3.0e38, float(np.finfo(np.float32).tiny)])
def test_threshold_keeps_exactly_the_strict_magnitudes(thr):
    """threshold's ``|x| > t`` through the one-pass scan (``>=`` the next float32 above t):
    entries at t, just above it, +-0, +-inf and NaN fall as the plain comparison puts them, in
    torch (compiled) and TF (its ops). (Subnormal thresholds keep the plain comparison.)"""
    tf = pytest.importorskip("tensorflow")
    from grace_dl.compressors.threshold import ThresholdCompressor

    a = _mixed(3000, 12)
    t32 = np.float32(thr)
    a[[100, 101, 102]] = [t32, -t32, np.nextafter(t32, np.float32(np.inf))]
    want = np.flatnonzero((a > t32) | (a < -t32))
    c = ThresholdCompressor(thr)
    for x in (torch.from_numpy(a), tf.constant(a)):
        payload, _ = c.compress(x, "g")
        np.testing.assert_array_equal(np.asarray(payload[1]), want)
        np.testing.assert_array_equal(np.asarray(payload[0]), a[want])


@pytest.mark.parametrize("words", [0, 1, 7, 100_003])
@pytest.mark.parametrize("key", [(0, "a", 0, 0), (3, "layer.weight/chunk1", 12345, 2),
                                 (2**31 - 1, "", 2**32 - 1, 0), (2**40 + 3, "é", 2**33 + 7, 2**35)])
def test_sfc64_gives_numpys_words_and_the_same_dither(words, key):
    """The compiled SFC64 is seeded as NumPy's SeedSequence seeds it and continues its state
    word for word, so every dither (torch's and TF's alike: both take seeding.dither's array)
    is unchanged."""
    from grace_dl import seeding

    want = seeding.generator(*key).bit_generator.random_raw(words)
    state = seeding.generator(*key).bit_generator.state["state"]["state"]
    np.testing.assert_array_equal(native.sfc64_raw(state, words), want)
    np.testing.assert_array_equal(seeding._raw_state(*key), state)   # seeded in C
    for bits in (8, 16):
        n = words * 64 // bits - 3 if words else 0
        got = seeding.dither(key[0], key[1], key[2], max(n, 0), bits, key[3])
        try:
            native.use(False)
            twin = seeding.dither(key[0], key[1], key[2], max(n, 0), bits, key[3])
        finally:
            native.use(True)
        np.testing.assert_array_equal(got, twin)
        assert got.dtype == twin.dtype


def test_the_kernels_benchmark_compares_every_case(capsys):
    """``python -m benchmarks.kernels --quick``: every kernel against its twin, one table."""
    from benchmarks import kernels

    assert kernels.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(kernels.cases(64))
    assert all(float(r.split("|")[4]) > 0 for r in rows[1:])      # twin / kernel
    assert native.in_use()                                          # left switched on
    # and each narrower SIMD path this CPU can run, timed as its own column
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    narrower = [b for b in (256, 0) if b < native.vector_bits()]
    assert header[5:] == [kernels.path_column(b) for b in narrower]
    assert all(float(v) > 0 for r in rows[1:] for v in r.strip("|").split("|")[5:])
    assert native.vector_bits() == native._CPU_BITS                 # the width restored


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 3 * (1 << 16) + 123])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_the_fused_server_step_equals_the_steps_on_every_path(every_path, n, ranks, nonfinite):
    """Vote of the ranks' payloads (ties and zeros included), added to the residual,
    re-encoded: payload (its status byte too: ``nonfinite`` puts an Inf and a NaN in the
    residual, in the vector part and in the tail), residual and signs bit for bit those of
    signsgd's combine, an add and compress_with_error run one after the other."""
    from grace_dl.compressors.base import LOCAL
    from grace_dl.compressors.signsgd import SignSGDCompressor

    c = SignSGDCompressor()
    rng = np.random.default_rng(n + ranks)
    xs = [torch.from_numpy(np.round(rng.standard_normal(n)).astype(np.float32))  # many zeros
          for _ in range(ranks)]
    payloads = [c.compress(x, f"r{r}")[0] for r, x in enumerate(xs)]
    ctx = c.compress(xs[0], "r0")[1]
    start = torch.from_numpy((rng.standard_normal(n) * 0.7).astype(np.float32))
    if nonfinite:
        start[0] = float("inf")
        start[n - 1] = float("nan")
    try:
        native.use(False)
        slot, dec = start.clone(), torch.empty(n)
        reduced = own(c).combine(payloads, ctx, dec)
        slot += reduced
        want_payload = own(c).compress_with_error(slot, "s", LOCAL, slot, dec)[0][0]
        want_slot, want_dec = slot, dec
    finally:
        native.use(True)
    path = Paths(c).on(start)
    for bits in every_path:
        native.limit_vector_bits(bits)
        slot, dec = start.clone(), torch.full((n,), 7.0)
        got = path.combine_with_feedback(payloads, ctx, slot, dec)
        assert got is not None
        np.testing.assert_array_equal(got[0].numpy(), want_payload.numpy(), err_msg=f"{bits}")
        np.testing.assert_array_equal(slot.numpy().view(np.uint32),
                                      want_slot.numpy().view(np.uint32), err_msg=f"{bits}")
        np.testing.assert_array_equal(dec.numpy().view(np.uint32),
                                      want_dec.numpy().view(np.uint32), err_msg=f"{bits}")


def test_a_flagged_rank_leaves_the_server_step_to_the_plain_path():
    """A rank's NaN (status byte set): no fused step; the steps then give NaN everywhere."""
    from grace_dl.compressors.signsgd import SignSGDCompressor

    c = SignSGDCompressor()
    x = torch.randn(100)
    bad = x.clone()
    bad[3] = float("nan")
    payloads = [c.compress(x, "a")[0], c.compress(bad, "b")[0]]
    ctx = c.compress(x, "a")[1]
    assert own(c).combine_with_feedback(payloads, ctx, torch.zeros(100), torch.empty(100)) is None


def _first_distinct_reference(key, n, j):
    """The first ``j`` distinct values of ``(w * n) >> 64`` over the key's SFC64 words, one
    Python integer at a time: what ``seeding.choice`` is defined to keep."""
    from grace_dl import seeding

    bits = seeding.generator(*key).bit_generator
    seen, order = set(), []
    while len(order) < j:
        for w in bits.random_raw(max(j, 16)).tolist():
            pos = (w * n) >> 64
            if pos not in seen and len(order) < j:
                seen.add(pos)
                order.append(pos)
    return seen


@pytest.mark.parametrize("n,k", [(0, 0), (1, 0), (1, 1), (10, 0), (10, 3), (10, 5), (10, 6),
                                 (10, 10), (63, 31), (64, 33), (65, 40), (129, 1), (1000, 999),
                                 (3 * (1 << 16) + 123, 1967), (4_194_304, 41_943)])
def test_choice_keeps_the_first_distinct_draws_compiled_and_twin(n, k):
    """``seeding.choice`` (randomk's positions, the sparsifiers' threshold sample): ascending,
    distinct, in range; the compiled kernel and its NumPy twin give the same array, and both
    are the first distinct values of the stream (their complement when k > n / 2)."""
    from grace_dl import seeding

    key = (7, "layer.weight", 12, 0)
    got = seeding.choice(*key[:3], n, k)
    try:
        native.use(False)
        twin = seeding.choice(*key[:3], n, k)
    finally:
        native.use(True)
    assert got.dtype == twin.dtype == np.int64
    np.testing.assert_array_equal(got, twin)
    assert got.size == k and np.all(np.diff(got) > 0)
    assert k == 0 or (got[0] >= 0 and got[-1] < n)
    if n <= 100_000:
        kept = _first_distinct_reference(key, n, min(k, n - k))
        want = kept if 2 * k <= n else set(range(n)) - kept
        assert set(got.tolist()) == want


def test_choice_twin_scales_exactly_beyond_32_bits():
    """The twin's 32-bit-halves product equals ``(w * n) >> 64`` in Python integers, for
    tensor sizes past 2**32 too (the kernel multiplies in 128 bits)."""
    from grace_dl import seeding

    w = seeding.generator(1, "big", 0).bit_generator.random_raw(2000)
    for n in (1, 3, 2**31 - 1, 2**32, 2**32 + 5, 2**40 + 12345, 2**63 - 1):
        want = [(int(x) * n) >> 64 for x in w]
        assert seeding._scaled(w, n).tolist() == want


def test_choice_is_uniform_over_positions():
    """Every position is kept about equally often (k/n of the draws): over 400 keys of 100 of
    1000 positions, each count stays within 6 standard deviations of 40, and the kept counts
    of the complement path (k > n / 2) too."""
    from grace_dl import seeding

    for k in (100, 900):
        counts = np.zeros(1000)
        for step in range(400):
            counts[seeding.choice(3, "u", step, 1000, k)] += 1
        mean = 400 * k / 1000
        sd = (400 * (k / 1000) * (1 - k / 1000)) ** 0.5
        assert np.abs(counts - mean).max() < 6 * sd, (k, counts.min(), counts.max())


@pytest.mark.parametrize("n,k", [(10, 11), (10, -1), (0, 1)])
def test_choice_refuses_more_than_there_is(n, k):
    from grace_dl import seeding

    with pytest.raises(ValueError, match=f"0 <= k <= n, got k={k}, n={n}"):
        seeding.choice(0, "x", 0, n, k)


def _top_twin(a, k, sign):
    """``sparse.top_of`` of ``magnitudes`` through torch's ops, the kernel switched off."""
    from grace_dl.compressors import sparse
    from grace_dl.torch import ops

    try:
        native.use(False)
        flat = torch.from_numpy(a)
        return sparse.top_of(ops, sparse.magnitudes(ops, flat, sign), k).numpy()
    finally:
        native.use(True)


def _tied(n, seed):
    """Few distinct values (many ties at every rank), zeros of both signs and NaNs."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-3, 4, n).astype(np.float32)
    a[rng.integers(0, n, max(1, n // 10))] = -0.0
    a[rng.integers(0, n, max(1, n // 20))] = np.nan
    return a


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (17, 5), (100, 1), (100, 37), (100, 100),
                                 (20480, 205), (200_003, 2001)])
@pytest.mark.parametrize("sign", [None, 1, -1])
@pytest.mark.parametrize("make", [_mixed, _tied])
def test_top_positions_equal_the_framework_top_k(n, k, sign, make):
    """The set and the order (above the k-th ascending, then the first ties ascending) of the
    framework-op path, with NaNs, infinities, zeros of both signs and heavy ties."""
    a = make(n, n + k)
    got = native.top_positions(a, k, sign)
    np.testing.assert_array_equal(got, _top_twin(a, k, sign))


def test_top_positions_of_equal_or_sorted_values_take_no_quadratic_path():
    """All equal (one three-way round) and sorted inputs (where a first-element pivot would go
    quadratic): the same positions as the framework path, at once."""
    for a in (np.zeros(300_000, np.float32), np.arange(300_000, dtype=np.float32),
              np.arange(300_000, 0, -1).astype(np.float32)):
        np.testing.assert_array_equal(native.top_positions(a, 3000), _top_twin(a, 3000, None))


def test_top_positions_refuse_what_they_do_not_take():
    a = _mixed(100, 1)
    assert native.top_positions(a, 0) is None and native.top_positions(a, 101) is None
    assert native.top_positions(a.astype(np.float64), 3) is None
    assert native.top_positions(a[::2], 3) is None


def test_topk_compressor_takes_the_kernel_and_keeps_its_positions():
    """topk through torch on CPU: the same payload with and without the kernel, exact (small
    tensor) and sampled (large) paths."""
    from grace_dl.compressors.topk import TopKCompressor

    for n in (2048, 300_000):
        x = torch.from_numpy(_mixed(n, 5))
        want = TopKCompressor(0.01).compress(x, "w")[0]
        try:
            native.use(False)
            twin = TopKCompressor(0.01).compress(x, "w")[0]
        finally:
            native.use(True)
        for got, ref in zip(want, twin):
            np.testing.assert_array_equal(got.numpy(), ref.numpy())


def _sparse_twin(n, positions, values):
    """Zeros, then ``index_add_`` of the joined payloads: what ``assign_scatter`` does."""
    out = torch.full((n,), 7.0)
    out.zero_()
    out.index_add_(0, torch.cat([torch.from_numpy(p) for p in positions]).long(),
                   torch.cat([torch.from_numpy(v) for v in values]))
    return out.numpy()


@pytest.mark.parametrize("n", [1, 100, 8191, 8192, 8193, 3 * 8192 + 17, 300_000])
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_sparse_sum_equals_zeroing_and_index_add(n, ranks, dtype):
    """Every block border, overlapping positions across ranks (added in rank order), signed
    zeros and both index dtypes."""
    rng = np.random.default_rng(n + ranks)
    positions, values = [], []
    for r in range(ranks):
        k = int(rng.integers(0, n + 1)) if r else n // 2
        positions.append(np.sort(rng.choice(n, k, replace=False)).astype(dtype))
        v = rng.standard_normal(k).astype(np.float32)
        v[: k // 7] = -0.0
        values.append(v)
    out = np.full(n, 7.0, np.float32)
    assert native.sparse_sum(out, positions, values) is out
    want = _sparse_twin(n, positions, values)
    np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))


def test_sparse_sum_leaves_what_it_cannot_take_untouched():
    """Unsorted or repeated positions, out of range, mixed dtypes: None, nothing written."""
    out = np.full(10, 7.0, np.float32)
    v = np.ones(3, np.float32)
    for p in ([3, 1, 5], [1, 1, 5], [1, 5, 10], [-1, 2, 3]):
        assert native.sparse_sum(out, [np.array(p, np.int32)], [v]) is None
    assert native.sparse_sum(out, [np.array([1, 2, 3], np.int32), np.array([1, 2, 3])],
                             [v, v]) is None
    assert native.sparse_sum(out, [np.array([1, 2, 3], np.int32)], [v[:2]]) is None
    assert (out == 7.0).all()


def test_a_bad_received_position_still_raises_through_the_framework_path():
    """A position outside the tensor (a corrupt payload) reaches torch's scatter, which
    raises, instead of a write outside the gradient."""
    from grace_dl.compressors import sparse
    from grace_dl.torch import ops

    out = torch.empty(10)
    with pytest.raises((IndexError, RuntimeError)):
        sparse.scatter_sum(ops, [torch.tensor([1, 12], dtype=torch.int32)],
                           [torch.ones(2)], ((10,), 10), out)


def test_topk_combine_takes_the_kernel_with_the_same_bits():
    from grace_dl.compressors.topk import TopKCompressor

    _sparse_sum = native.sparse_sum

    c = TopKCompressor(0.01)
    a, b = (torch.from_numpy(_mixed(300_000, s)).nan_to_num(0.0) for s in (1, 2))
    (pa, ctx), (pb, _) = c.compress(a, "w"), c.compress(b, "w")
    calls = []
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(native, "sparse_sum", lambda *a: calls.append(_sparse_sum(*a)) or calls[-1])
        got = Paths(c).on(a).combine([pa, pb], ctx, torch.empty(300_000))
    assert len(calls) == 1 and calls[0] is not None    # applied: both rank's positions sorted
    want = own(c).combine([pa, pb], ctx, torch.empty(300_000))       # the reference
    np.testing.assert_array_equal(got.numpy().view(np.int32), want.numpy().view(np.int32))


def test_cpu_sparse_sum_falls_back_for_what_numpy_cannot_view():
    """bfloat16 values (no NumPy dtype) and float64 gradients go to the framework scatter."""
    from grace_dl.native import paths

    pos = [torch.tensor([1, 2], dtype=torch.int32)]
    assert paths._sparse_sum(torch.empty(10), pos, [torch.ones(2, dtype=torch.bfloat16)]) \
        is None
    assert paths._sparse_sum(torch.empty(10, dtype=torch.float64), pos,
                             [torch.ones(2, dtype=torch.float64)]) is None
    out = torch.full((10,), 7.0)
    assert paths._sparse_sum(out, pos, [torch.ones(2)]) is out
    assert out.tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]


def test_a_cpu_without_simd_leaves_the_scan_sign_code_and_vote_to_the_framework(monkeypatch):
    """Their scalar loops are slower than the framework ops (``native._vectorized``): on a CPU
    with no SIMD path the scan, the sign code and the server step decline (the CPU path's
    scan then gives NumPy's positions), while the kernels whose scalar loops win (the ternary
    decode here) still run."""
    monkeypatch.setattr(native, "_CPU_BITS", 0)
    a = _mixed(1000, 3)
    assert native.positions_at_least(a, 1.5) is None
    np.testing.assert_array_equal(COMPILED.at_least(ops, torch.from_numpy(a), 1.5),
                                  np.flatnonzero(np.abs(a) >= np.float32(1.5)))
    assert native.sign_planes(a) is None
    planes = np.zeros(2 * 125, np.uint8)
    assert native.sign_vote_feedback([planes, planes], 1000, np.zeros(1000, np.float32),
                                     np.zeros(1000, np.float32)) is None
    out = np.empty(1000, np.float32)
    assert native.ternary(planes[:125], planes[125:], 1000, out) is out
    monkeypatch.setattr(native, "_CPU_BITS", 256)
    assert native.sign_planes(a) is not None


def _kth_cases():
    rng = np.random.default_rng(7)
    normal = rng.standard_normal(59_000).astype(np.float32)
    mag = np.abs(normal)
    mag[::7] = -1.0                                             # NaN / other sign, as ranked
    ties = np.repeat(np.float32([3.0, 1.0, 0.5, 0.0]), 5000)    # one value fills a whole bin
    close = (np.float32(1.0) + np.arange(5000, dtype=np.float32) * np.float32(2 ** -23))
    special = np.float32([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0])
    return {"normal": normal, "magnitudes": mag, "ties": ties, "last bits": close,
            "special": special, "one": np.float32([2.5])}


@pytest.mark.parametrize("case", sorted(_kth_cases()))
def test_kth_largest_is_numpys_partition(case):
    """The radix select gives the value NumPy's partition puts at n - k, for every k tried
    (first, last, middle, bin edges), on magnitudes, signed values, ties filling a bin, values
    that differ in the last bits only, and infinities, subnormals and signed zeros."""
    a = _kth_cases()[case]
    n = a.size
    ks = sorted(k for k in {1, 2, n // 100 + 1, n // 3 + 1, n // 2 + 1, n - 1, n} if 0 < k <= n)
    for k in ks:
        got = native.kth_largest(a, k)
        want = np.partition(a, n - k)[n - k]
        assert got == want, (case, k, got, want)    # equal as floats (+0.0 == -0.0)
        assert (a >= got).sum() >= k and (a > got).sum() < k
    assert native.kth_largest(a, 0) is None and native.kth_largest(a, n + 1) is None
    assert native.kth_largest(a.astype(np.float64), 1) is None


def test_cpu_selection_takes_the_radix_select_and_matches_topk(monkeypatch):
    """The CPU path's k-th largest is the radix select's for float32 (NumPy's partition, the
    framework ops', for float64), the value ``torch.topk`` gives."""
    x = torch.from_numpy(_kth_cases()["magnitudes"])
    selects = []
    kernel = native.kth_largest
    monkeypatch.setattr(native, "kth_largest", lambda a, k: selects.append(k) or kernel(a, k))
    for k in (1, 590, 42_000, x.numel()):
        want = torch.topk(x, k).values.min()
        assert COMPILED.kth_largest(ops, x, k) == want and selects[-1] == k
        assert ops.kth_largest(x, k) == want
        assert COMPILED.kth_largest(ops, x.double(), k) == want.double()
    assert len(selects) == 4
