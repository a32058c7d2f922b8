"""Each Triton kernel of the device path against its torch twin, on random inputs of sizes
that do and do not fill whole programs.

    TRITON_INTERPRET=1 python tests/kernel_checks.py      # on the CPU, in Triton's interpreter
    python tests/kernel_checks.py cuda                    # compiled, on a GPU

``tests/test_device_kernels.py`` runs the first form. The kernels and their twins do the same
float operations in the same order (the kernels are launched without multiply-add
contraction), so their outputs are equal bit for bit, except sums reduced in another order
(qsgd's row norms, sketch's bucket sums), which agree to float rounding. Prints one line per
size and exits non-zero on the first difference.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grace_dl.compressors import sparse  # noqa: E402
from grace_dl.compressors.u8bit import _CELL_INDEX, _CELL_SPLIT  # noqa: E402
from grace_dl.torch import ops  # noqa: E402
from grace_dl.torch.kernels import codes, philox, select, triton_for  # noqa: E402

SIZES = {"cpu": (1, 33, 4100), "cuda": (1, 33, 4096, 5000, 70001, 1 << 22)}


def twin(fn, *args, **kwargs):
    """``fn`` with the Triton kernels switched off: its torch twin."""
    codes.triton_for = philox.triton_for = select.triton_for = lambda t: False
    try:
        return fn(*args, **kwargs)
    finally:
        codes.triton_for = philox.triton_for = select.triton_for = triton_for


def equal(a, b, what):
    """Bit for bit, except that any NaN equals any NaN (a GPU's negation may leave a NaN's
    sign bit as it was)."""
    if a.dtype == b.dtype and a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            raise AssertionError(f"{what}: kernel and twin have NaN at other places")
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits)[~nan], b.view(bits)[~nan]
    if not torch.equal(a, b):
        diff = (a != b).nonzero()[:5].reshape(-1).tolist()
        raise AssertionError(f"{what}: kernel and twin differ at {diff}")


@contextlib.contextmanager
def _set(module, **values):
    """``module``'s constants set to ``values`` within the block."""
    before = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(module, k, v)


def check_selection(x) -> None:
    """``select.radix_positions``: kernel, twin and the reference sparsifiers' ``exact_top``
    give the same positions, with NaN, infinities, zeros and ties at the cut, for each sign (and
    each dtype of magnitudes); and with several blocks a histogram program."""
    n = x.numel()
    y = x.clone()
    if n > 40:
        y[3], y[5], y[7], y[9] = float("nan"), float("inf"), -float("inf"), 0.0
        y[10:20], y[20:30], y[30:40] = 1.5, -1.5, 0.0
    for dt, signs in ((torch.float32, (0, 1, -1)), (torch.float16, (0,)), (torch.bfloat16, (0,))):
        v = y.to(dt)
        for sign in signs:
            have = n if sign == 0 else int((v > 0).sum() if sign > 0 else (v < 0).sum())
            for k in sorted({1, max(1, n // 100), max(1, n // 3), have} - {0}):
                if k > have:
                    continue
                want = sparse.exact_top(ops, v.cpu(), k, sign or None).long()
                got = select.radix_positions(v, k, sign)
                equal(got.cpu(), want, f"top {k} of {n} {dt} sign={sign}")
                equal(twin(select.radix_positions, v, k, sign).cpu(), want,
                      f"top twin {k} of {n} {dt} sign={sign}")
    with _set(select, HISTOGRAM_PROGRAMS=1):     # (each program then takes every block)
        k = max(1, n // 7)
        equal(select.radix_positions(y, k).cpu(), sparse.exact_top(ops, y.cpu(), k).long(),
              f"top {k} of {n}, one histogram program")
    # ``top_positions``: below RADIX_MIN torch.topk's (the reference's entries where no tie
    # meets the cut, in any order), from it the radix select's
    z = x.clone()
    z[n // 2] = float("nan")
    for sign in (0, 1, -1):
        have = n if sign == 0 else int((z > 0).sum() if sign > 0 else (z < 0).sum())
        for k in sorted({1, max(1, n // 100), have} - {0}):
            want = sparse.exact_top(ops, z.cpu(), k, sign or None).long()
            got = torch.sort(select.top_positions(z, k, sign)).values
            equal(got.cpu(), want, f"top_positions {k} of {n} sign={sign}")
    with _set(select, RADIX_MIN=n):
        k = max(1, n // 3)
        equal(select.top_positions(y, k).cpu(), sparse.exact_top(ops, y.cpu(), k).long(),
              f"top_positions {k} of {n} from RADIX_MIN")


def check_signs(x, gen) -> None:
    """The vote of pure-sign payloads (with and without zero planes, ties, a NaN) and what a
    payload's signs lose (float32, 16-bit and float64, a status byte set and clear)."""
    n, device = x.numel(), x.device
    nbytes = codes.packed_size(n, 1)
    sides = torch.randint(-1, 2, (5, n), device=device, generator=gen).to(torch.float32)
    sides[1] = sides[0].abs()       # no exact zero: a payload without its zero plane
    payloads = []
    for v in sides:
        buf, flags = twin(codes.sign_payload, v)
        payloads.append(buf[:(2 * nbytes if bool(flags[1]) else nbytes) + 1])
    many = payloads * 26     # 130 payloads: a 16-bit count
    for group in (payloads[:1], payloads[:2], payloads[:4], payloads, many):
        got, want = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
        codes.sign_vote(group, n, got)
        twin(codes.sign_vote, group, n, want)
        equal(got, want, f"sign vote of {len(group)}")
        truth = torch.sign(sides.repeat(26, 1)[:len(group)].sum(0))
        assert torch.equal(want, truth), f"sign vote of {len(group)}: not the majority"
    bad = payloads[2].clone()
    bad[-1] |= 1
    got = codes.sign_vote([payloads[0], bad], n, torch.empty_like(x))
    assert got.isnan().all(), "sign vote: a flagged payload makes every element NaN"
    y = x.clone()
    y[: min(n, 2)] = torch.tensor([0.0, -0.0], device=device)[: min(n, 2)]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        v = y.to(dtype) if dtype != torch.float64 else y.to(dtype) * (1 + 1e-12)
        for status in (0, 2, 1, 3):
            s = torch.tensor([status], dtype=torch.uint8, device=device)
            outs = [torch.full_like(v, 7.0) for _ in range(4)]
            codes.sign_error(v, s, outs[0], outs[1])
            twin(codes.sign_error, v, s, outs[2], outs[3])
            equal(outs[0], outs[2], f"sign error {dtype} status {status}")
            equal(outs[1], outs[3], f"sign decoded {dtype} status {status}")
            if status & 1:
                assert (outs[2] == 0).all() and outs[3].isnan().all()
            else:
                equal(outs[2], v - torch.sign(v), f"sign error twin {dtype}")


def check_large_counts(device) -> None:
    """Packed streams of ``n * bits >= 2**31`` bits: program 0 alone (one block, no memory of
    that size) stores and loads its codes as at any size (the bytes' bound once wrapped in
    int32 and masked every store)."""
    from grace_dl.torch.kernels import jit_codes

    block = 4096
    for bits, n in ((2, (1 << 30) + block), (7, (1 << 29) + block)):
        c = torch.full((block,), (1 << bits) - 3, dtype=torch.uint8, device=device)
        out = torch.full((block * bits // 8,), 0xAB, dtype=torch.uint8, device=device)
        jit_codes.pack[(1,)](c, out, n, BITS=bits, BLOCK=block)
        equal(out, codes.pack_twin(c, bits), f"pack {bits} bits of n={n}")
        table = torch.arange(1 << bits, dtype=torch.float32, device=device)
        got = torch.zeros(block, device=device)
        jit_codes.decode[(1,)](torch.cat([out, out.new_zeros(1)]), table, table, got, n, 1, 1.0,
                               BITS=bits, SIGN=False, SCALED=False, ACCUMULATE=False,
                               BLOCK=block)
        equal(got, c.to(torch.float32), f"decode {bits} bits of n={n}")


def check(device, n: int) -> None:
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, device=device, generator=gen)
    x[0] = 0.0
    key = philox.device_key(3, "w")
    equal(philox.words(key, 5, 1, n, x), twin(philox.words, key, 5, 1, n, x), "words")
    equal(codes.abs_max_bits(x), twin(codes.abs_max_bits, x), "abs_max")
    for bad in (None, float("nan"), float("-inf")):
        y = x.clone()
        if bad is not None:
            y[n - 1] = bad
        for v in (y, y.to(torch.bfloat16)):
            got, want = codes.nonfinite_mark(v), twin(codes.nonfinite_mark, v)
            equal(got, want, f"nonfinite mark {bad} {v.dtype}")
            assert got.shape == () and got.dtype == v.dtype
            assert got.isnan() if bad is not None else torch.signbit(got) and got == 0
    for v in (torch.tensor([-0.0, 0.0], device=device), x.to(torch.float64)):
        got, want = codes.nonfinite_mark(v), twin(codes.nonfinite_mark, v)
        assert torch.signbit(got) and got == 0 and torch.signbit(want) and want == 0, v.dtype
    for total, k in ((n, min(n, 3)), (n + 1000, max(1, n // 100)), (97, 40), (97, 60)):
        got = philox.choice(key, 5, total, k, x)
        equal(got, twin(philox.choice, key, 5, total, k, x), f"choice {k} of {total}")
        assert got.unique().numel() == k and int(got.max()) < total, f"choice {k} of {total}"
    for row in (1, 5, 512, 1000):
        a, b = codes.row_norms(x, row), twin(codes.row_norms, x, row)
        assert torch.allclose(a, b, rtol=1e-6), f"row_norms {row}"
    for s, bits, row in ((127, 8, 37), (7, 4, 512), (1, 2, 37), (3, 3, 64), (31, 6, 1000)):
        dither = 8 if s >= 64 else 16
        outs = [[torch.empty_like(x), torch.empty_like(x)] for _ in range(2)]
        a, na = codes.qsgd_encode(x, row, float(s), 2 * s, bits, dither, key, 5, 1, *outs[0])
        b, nb = twin(codes.qsgd_encode, x, row, float(s), 2 * s, bits, dither, key, 5, 1,
                     *outs[1])
        assert torch.allclose(na, nb, rtol=1e-6), f"qsgd norms s={s}"
        if torch.equal(na, nb):     # (codes follow the norms: equal where the norms are)
            equal(a, b, f"qsgd codes s={s}")
            equal(outs[0][0], outs[1][0], "qsgd error")
            equal(outs[0][1], outs[1][1], "qsgd decoded")
        else:   # a norm off by a rounding moves a code by at most one level, and rarely
            ca, cb = (codes.unpack(p, bits, n).to(torch.int32) for p in (a, b))
            off = (ca - cb).abs()
            assert int(off.max()) <= 1 and float((off > 0).float().mean()) < 1e-3, \
                f"qsgd codes s={s}: {int((off > 0).sum())} of {n} differ, by up to {int(off.max())}"
        table = torch.arange(1 << bits, dtype=torch.float32, device=device) - s
        got, want = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
        codes.decode(a, bits, n, table, got, na, row, float(s), accumulate=True)
        twin(codes.decode, a, bits, n, table, want, na, row, float(s), accumulate=True)
        equal(got, want, f"decode {bits} bits")
        assert torch.allclose(got - 7.0, outs[0][1], atol=1e-5), "decode of qsgd's own codes"
    for sign in (False, True):
        table = torch.tensor([0.5, -2.0], device=device)
        plane = codes.onebit_encode(x)[0]
        got, want = torch.empty_like(x), torch.empty_like(x)
        codes.decode(plane, 1, n, table, got, sign=sign)
        twin(codes.decode, plane, 1, n, table, want, sign=sign)
        equal(got, want, f"decode 1 bit sign={sign}")
    a, b = codes.terngrad_encode(x, key, 2, 0), twin(codes.terngrad_encode, x, key, 2, 0)
    equal(a[0], b[0], "terngrad")
    equal(a[1], b[1], "terngrad scaler")
    for scale in (1e30, 1.0, 1e-30):
        big = x * scale
        a, b = codes.natural_encode(big, key, 2, 0), twin(codes.natural_encode, big, key, 2, 0)
        equal(a[0], b[0], f"natural x{scale}")
        equal(a[1], b[1], f"natural base x{scale}")
        equal(codes.natural_table(a[1]), twin(codes.natural_table, a[1]), "natural table")
    index = torch.from_numpy(_CELL_INDEX).to(device)
    split = torch.from_numpy(_CELL_SPLIT).to(device)
    a, b = codes.u8bit_encode(x, index, split), twin(codes.u8bit_encode, x, index, split)
    equal(a[0], b[0], "u8bit")
    equal(a[1], b[1], "u8bit scaler")
    y = x.clone()
    y[n // 2] = float("inf") if n > 2 else y[n // 2]
    for v in (x, y, x + 10.0):
        nbytes = codes.packed_size(n, 1)
        (buf, flags), (tbuf, tflags) = codes.sign_payload(v), twin(codes.sign_payload, v)
        zeros = bool(tflags[1])
        end = 2 * nbytes if zeros else nbytes
        equal(buf, tbuf, "sign payload (the whole buffer)")
        equal(flags[:2], tflags, "sign payload flags")
        assert int(buf[end]) == int(buf[-1]) == int(tflags[0]) | 2 * zeros, \
            "sign payload status byte (where the cut payload ends, and at the end)"
        whole, cut = torch.empty_like(v), torch.empty_like(v)
        codes.sign_decode(buf, n, whole)
        codes.sign_decode(buf[:end + 1], n, cut)
        equal(whole, cut, "sign decode: the whole buffer is the payload cut to its size")
        for end, status in ((nbytes, 1), (2 * nbytes, 2)):      # without, with the zero plane
            packed = buf[:end + 1].clone()
            packed[end] = status
            got, want = torch.empty_like(v), torch.empty_like(v)
            codes.sign_decode(packed, n, got)
            twin(codes.sign_decode, packed, n, want)
            equal(got, want, f"sign decode, status {status}")
            assert got.isnan().all() if status == 1 else not got.isnan().any()
    for fn in (codes.onebit_encode, codes.efsign_encode):
        a, b = fn(x), twin(fn, x)
        equal(a[0], b[0], f"{fn.__name__} plane")
        assert torch.allclose(a[1], b[1], rtol=1e-5, atol=1e-6), f"{fn.__name__} scalars"
    check_signs(x, gen)
    for bits in (1, 2, 3, 6):
        c = torch.randint(0, 1 << bits, (n,), device=device, generator=gen).to(torch.uint8)
        packed = codes.pack(c, bits)
        equal(packed, twin(codes.pack, c, bits), f"pack {bits} bits")
        equal(codes.unpack(packed, bits, n), c, f"unpack {bits} bits")
        equal(twin(codes.unpack, packed, bits, n), c, f"unpack twin {bits} bits")
    check_selection(x)
    y = x.clone()
    y[n // 2] = float("nan")
    equal(codes.magnitudes(y), twin(codes.magnitudes, y), "magnitudes")
    key = philox.device_key(3, "w")
    for s in (1, min(n, 5), 2 * n + 1):
        got = philox.sampled_magnitudes(key, 2, n, s, y)
        equal(got, twin(philox.sampled_magnitudes, key, 2, n, s, y), f"sampled magnitudes {s}")
        w = twin(philox.words, key, 2, 0, 2 * s, y).reshape(s, 2)
        at = philox.scaled(w[:, 0], w[:, 1], n)     # choice's stream: its draws, repeats kept
        equal(got, twin(codes.magnitudes, y.index_select(0, at)), f"sampled positions {s}")
    for thr in (0.5, torch.tensor([0.5], device=device), torch.tensor([0.0], device=device)):
        for strict in (False, True):
            got, want = codes.above(y, thr, strict), twin(codes.above, y, thr, strict)
            equal(got.to(torch.bool), want, f"above {thr} strict={strict}")
    y = x * 2.0 ** -6           # every class: |x| / d below 1, below 2**7, below 2**15, above
    y[: min(n, 3)] = torch.tensor([40.0, float("nan"), -1e-6], device=device)[: min(n, 3)]
    for raw in (y, y.to(torch.float16)):
        a = codes.inceptionn_encode(y, raw, 2.0**-10)
        b = twin(codes.inceptionn_encode, y, raw, 2.0**-10)
        for got, want, what in zip(a, b, ("tags", "v1", "v2", "v3")):
            equal(got, want, f"inceptionn {what}")
        equal(codes.inceptionn_decode(*a, n, 2.0**-10),
              twin(codes.inceptionn_decode, *a, n, 2.0**-10), "inceptionn decode")
    for q, bits in ((2, 1), (10, 4), (64, 6)):
        ranked = torch.sort(torch.randn(2 * q + 3, device=device, generator=gen)).values
        lo = torch.arange(1, q, device=device) * 2
        hi, w = lo + 1, torch.rand(q - 1, device=device, generator=gen)
        edges = codes.sketch_edge_keys(ranked, lo, hi, w)
        equal(edges, twin(codes.sketch_edge_keys, ranked, lo, hi, w), f"sketch edges q={q}")
        a, b = codes.sketch_encode(x, edges, q, bits), twin(codes.sketch_encode, x, edges, q,
                                                             bits)
        equal(a[0], b[0], f"sketch buckets q={q}")
        # a bucket's sum is added in another order (a one-hot accumulator, program rows): a
        # float32 rounding error that grows as a random walk over the terms
        bound = 4 * 2.0**-24 * n**0.5 * x.abs().sum().item() + 1e-3
        assert ((a[1] - b[1]).abs() <= bound).all(), f"sketch sums q={q}"
        equal(a[2], b[2], f"sketch counts q={q}")


def main(argv) -> int:
    device = torch.device(argv[1] if len(argv) > 1 else "cpu")
    if not triton_for(torch.empty(0, device=device)):
        print("Triton does not run here (CUDA or TRITON_INTERPRET=1 needed)")
        return 2
    check_large_counts(device)
    for n in SIZES[device.type]:
        check(device, n)
        print(f"kernels equal their twins at n={n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


# ------------------------------------------------------------------ compiled for a GPU
#: each kernel with the argument types and constants it is launched with (one of each kind)
SIGNATURES = [
    ("jit_random", "words", {"out_ptr": "*i64", "n": "i32", "k0": "i64", "k1": "i32",
                             "step": "i32", "stream": "i32"}, {"BLOCK": 4096}),
    *[("jit_codes", "decode", {"packed_ptr": "*u8", "table_ptr": "*fp32",
                               "scale_ptr": "*fp32", "out_ptr": out, "n": "i32", "row": "i32",
                               "divisor": "fp32"},
       {"BITS": bits, "SIGN": sign, "SCALED": scaled, "ACCUMULATE": acc, "BLOCK": 4096})
      for out, bits, sign, scaled, acc in (("*fp32", 8, False, True, True),
                                           ("*bf16", 3, False, False, False),
                                           ("*fp32", 1, True, False, True))],
    ("jit_codes", "abs_max", {"x_ptr": "*fp32", "acc_ptr": "*i32", "n": "i32"},
     {"BLOCK": 4096}),
    ("jit_codes", "nonfinite", {"x_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32"},
     {"BLOCK": 4096}),
    ("jit_codes", "row_norms", {"x_ptr": "*fp32", "norms_ptr": "*fp32", "n": "i32",
                                "row": "i32", "rows": "i32"},
     {"ROWS": 8, "COLS": 512, "TILES": 1}),
    *[("jit_codes", "qsgd_encode",
       {"x_ptr": "*fp32", "norms_ptr": "*fp32", "out_ptr": "*u8", "err_ptr": "*fp32",
        "dec_ptr": "*fp32", "n": "i32", "row": "i32", "s": "fp32", "hi": "i32", "k0": "i64",
        "k1": "i32", "step": "i32", "stream": "i32"},
       {"DITHER": 8 if bits == 8 else 16, "BITS": bits, "ERROR": bits == 8,
        "DECODED": bits == 8, "BLOCK": 4096}) for bits in (8, 3)],
    *[("jit_codes", "qsgd_rows",
       {"x_ptr": "*fp32", "norms_ptr": "*fp32", "out_ptr": "*u8", "err_ptr": "*fp32",
        "dec_ptr": "*fp32", "n": "i32", "s": "fp32", "hi": "i32", "k0": "i64", "k1": "i32",
        "step": "i32", "stream": "i32"},
       {"ROW": row, "ROWS": 4096 // row, "DITHER": 8, "BITS": bits, "ERROR": True, "DECODED": False,
        "BLOCK": 4096}) for row, bits in ((512, 8), (4096, 4), (32, 6))],
    ("jit_codes", "terngrad_encode", {"x_ptr": "*fp32", "acc_ptr": "*i32", "out_ptr": "*u8",
                                      "scaler_ptr": "*fp32", "n": "i32", "k0": "i32",
                                      "k1": "i64", "step": "i32", "stream": "i32"},
     {"BLOCK": 4096}),
    ("jit_codes", "natural_encode", {"x_ptr": "*fp32", "acc_ptr": "*i32", "out_ptr": "*u8",
                                     "base_ptr": "*i32", "n": "i32", "k0": "i32", "k1": "i64",
                                     "step": "i32", "stream": "i32"}, {"BLOCK": 4096}),
    ("jit_codes", "natural_table", {"base_ptr": "*i32", "out_ptr": "*fp32"}, {}),
    ("jit_codes", "u8bit_encode", {"x_ptr": "*fp32", "acc_ptr": "*i32", "index_ptr": "*u8",
                                   "split_ptr": "*fp32", "out_ptr": "*u8",
                                   "scaler_ptr": "*fp32", "n": "i32"}, {"BLOCK": 4096}),
    ("jit_codes", "sign_planes", {"x_ptr": "*fp16", "neg_ptr": "*u8", "zero_ptr": "*u8",
                                  "part_ptr": "*fp32", "flags_ptr": "*i32", "n": "i32",
                                  "status_ptr": "*u8", "nbytes": "i32"},
     {"ZERO": True, "STATS": True, "FLAGS": True, "STATUS": True, "BLOCK": 4096}),
    ("jit_codes", "sign_scalars", {"part_ptr": "*fp32", "programs": "i32", "n": "i32",
                                   "out_ptr": "*fp32"}, {"MEANS": True, "CHUNK": 1024, "LOOPS": 2}),
    ("jit_codes", "sign_error", {"x_ptr": "*bf16", "status_ptr": "*u8", "err_ptr": "*bf16",
                                 "dec_ptr": "*bf16", "n": "i32"},
     {"DECODED": True, "BLOCK": 4096}),
    *[("jit_codes", "sign_count", {"packed_ptr": "*u8", "count_ptr": count, "n": "i32",
                                   "nbytes": "i32", "status_at": "i32"},
       {"ZERO": zero, "FIRST": first, "BLOCK": 4096})
      for count, zero, first in (("*i8", True, True), ("*i16", False, False))],
    ("jit_codes", "vote_decode", {"count_ptr": "*i8", "out_ptr": "*fp32", "n": "i32"},
     {"BLOCK": 4096}),
    ("jit_codes", "above", {"x_ptr": "*fp32", "thr_ptr": "*fp32", "out_ptr": "*u8", "n": "i32",
                            "thr": "fp32"}, {"FROM_PTR": True, "STRICT": False, "BLOCK": 4096}),
    ("jit_random", "positions", {"out_ptr": "*i32", "draws": "i32", "n": "i32", "k0": "i32",
                                 "k1": "i64", "step": "i32", "stream": "i32"}, {"BLOCK": 4096}),
    ("jit_random", "sampled_magnitudes", {"x_ptr": "*fp16", "out_ptr": "*fp32", "draws": "i32",
                                          "n": "i32", "k0": "i32", "k1": "i64", "step": "i32",
                                          "stream": "i32"}, {"BLOCK": 4096}),
    ("jit_random", "first_draws", {"ranked_ptr": "*i32", "order_ptr": "*i64", "out_ptr": "*i32",
                                   "draws": "i32"}, {"BLOCK": 4096}),
    ("jit_random", "kept", {"ranked_ptr": "*i32", "order_ptr": "*i64", "running_ptr": "*i32",
                            "out_ptr": "*i32", "draws": "i32", "j": "i32"}, {"BLOCK": 4096}),
    ("jit_random", "place", {"ranked_ptr": "*i32", "keep_ptr": "*i32", "running_ptr": "*i32",
                             "out_ptr": "*i64", "draws": "i32"}, {"BLOCK": 4096}),
    ("jit_codes", "sign_decode", {"packed_ptr": "*u8", "out_ptr": "*fp32", "n": "i32",
                                  "nbytes": "i32", "status_at": "i32"},
     {"ZERO": True, "BLOCK": 4096}),
    ("jit_codes", "sketch_encode", {"x_ptr": "*fp32", "edges_ptr": "*i32", "n_edges": "i32",
                                    "out_ptr": "*u8", "part_ptr": "*fp32", "n": "i32"},
     {"BITS": 6, "Q": 64, "STEPS": 7, "BLOCK": 2048, "SUB": 128}),
    ("jit_codes", "sketch_edges", {"ranked_ptr": "*fp32", "lo_ptr": "*i64", "hi_ptr": "*i64",
                                   "w_ptr": "*fp32", "out_ptr": "*i32", "m": "i32"},
     {"WIDTH": 64}),
    ("jit_codes", "pack", {"codes_ptr": "*u8", "out_ptr": "*u8", "n": "i32"},
     {"BITS": 2, "BLOCK": 4096}),
    ("jit_codes", "unpack", {"packed_ptr": "*u8", "out_ptr": "*u8", "n": "i32"},
     {"BITS": 6, "BLOCK": 4096}),
    ("jit_codes", "magnitudes", {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32"},
     {"BLOCK": 4096}),
    *[("jit_select", "histogram", {"x_ptr": x, "state_ptr": "*i32", "prev_ptr": "*i32",
                                   "out_state_ptr": "*i32", "hist_ptr": "*i32", "n": "i32",
                                   "k": "i32", "tiles": "i32"},
       {"SIGN": sign, "PREV": prev, "FROM_STATE": state, "PREV_BINS": 64,
        "PREV_BITS": 6, "SHIFT": shift, "BITS": bits, "BINS": 1 << bits, "BLOCK": 4096})
      for x, sign, prev, state, shift, bits in (("*fp32", 0, False, False, 25, 6),
                                                ("*fp16", 1, True, False, 19, 6),
                                                ("*bf16", -1, True, True, 0, 7))],
    ("jit_select", "tally", {"x_ptr": "*fp32", "state_ptr": "*i32", "hist_ptr": "*i32",
                             "out_state_ptr": "*i32", "counts_ptr": "*i64", "n": "i32",
                             "programs": "i32"}, {"SIGN": 0, "BINS": 128, "BITS": 7,
                                                  "BLOCK": 4096}),
    ("jit_select", "place", {"x_ptr": "*fp16", "state_ptr": "*i32", "offsets_ptr": "*i64",
                             "out_ptr": "*i64", "n": "i32", "programs": "i32"},
     {"SIGN": -1, "BLOCK": 4096}),
    ("jit_codes", "inceptionn_classify", {"x_ptr": "*fp32", "tags_ptr": "*u8",
                                          "counts_ptr": "*i64", "n": "i32", "inv_d": "fp32"},
     {"BLOCK": 4096}),
    ("jit_codes", "inceptionn_compact", {"x_ptr": "*fp32", "raw_ptr": "*fp16",
                                         "offsets_ptr": "*i64", "v1_ptr": "*i8",
                                         "v2_ptr": "*i16", "v3_ptr": "*fp16", "n": "i32",
                                         "inv_d": "fp32"}, {"BLOCK": 4096}),
    ("jit_codes", "inceptionn_counts", {"tags_ptr": "*u8", "counts_ptr": "*i64", "n": "i32"},
     {"BLOCK": 4096}),
    ("jit_codes", "inceptionn_expand", {"tags_ptr": "*u8", "offsets_ptr": "*i64",
                                        "v1_ptr": "*i8", "v2_ptr": "*i16", "v3_ptr": "*fp32",
                                        "out_ptr": "*fp32", "n": "i32", "d": "fp32"},
     {"BLOCK": 4096}),
]


def compile_all(arch: int = 90) -> list[str]:
    """Compile every kernel for an NVIDIA GPU of compute capability ``arch`` (Hopper: 90),
    ahead of time, with no GPU: Triton's front end and ptxas find what its interpreter does
    not (globals that are not ``tl.constexpr``, types the hardware lacks). Returns the
    kernels compiled."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    done = []
    for module, name, signature, constants in SIGNATURES:
        fn = getattr(importlib.import_module(f"grace_dl.torch.kernels.{module}"), name)
        sig = {**signature, **{k: "constexpr" for k in constants}}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constants),
                       target=GPUTarget("cuda", arch, 32),
                       options={"enable_fp_fusion": False})
        done.append(name)
    return done
