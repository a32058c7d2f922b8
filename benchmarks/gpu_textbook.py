"""The textbook torch version of each method, for ``benchmarks/gpu.py`` to hold grace_dl's
device path against: written the way GRACE's torch library writes them (plain tensor ops,
``torch.rand_like`` for randomness, ``torch.randperm`` for random-k, boolean masks and
``nonzero`` where a method selects), one function per method returning ``(compress,
decompress)``, each a function of the tensor and of what compress returned.

They are baselines of *speed*, not of the wire: most send more bits than the method promises
(signs as int8, ternary values as int8) and none is bit-packed.
"""

from __future__ import annotations

import math

import torch

RATIO = 0.01
THRESHOLD = 2.576    # keeps 1% of N(0, 1) values


def _sparse(values_at):
    def decompress(x, payload):
        values, idx = payload
        return torch.zeros_like(x).scatter_(0, idx, values)
    return values_at, decompress


def fp16():
    return (lambda x: x.half()), (lambda x, p: p.float())


def bf16():
    return (lambda x: x.bfloat16()), (lambda x, p: p.float())


def qsgd(s=127, bucket=512):
    def compress(x):
        rows = x.view(-1, bucket)
        norm = rows.norm(dim=1, keepdim=True)
        level = rows.abs() * (s / norm)
        low = level.floor()
        up = torch.rand_like(level) < (level - low)
        return ((low + up) * rows.sign()).to(torch.int16), norm

    def decompress(x, payload):
        q, norm = payload
        return (q.float() * (norm / s)).view(-1)
    return compress, decompress


def terngrad():
    def compress(x):
        m = x.abs().max()
        keep = torch.rand_like(x) < x.abs() / m
        return (x.sign() * keep).to(torch.int8), m
    return compress, (lambda x, p: p[0].float() * p[1])


def natural():
    def compress(x):
        bits = x.view(torch.int32)
        sign = bits & -2147483648
        exp = bits & 0x7F800000
        up = (bits & 0x7FFFFF) > torch.randint(0, 0x7FFFFF, x.shape, device=x.device,
                                                dtype=torch.int32)
        exp = torch.where(up, exp + 0x800000, exp)
        return ((exp >> 23) | (sign >> 24)).to(torch.uint8)

    def decompress(x, codes):
        c = codes.to(torch.int32)
        mag = ((c & 0x7F) << 23).view(torch.float32)
        return torch.where(c > 127, -mag, mag)
    return compress, decompress


def u8bit():
    from grace_dl.compressors.u8bit import _MIDPOINTS, _TABLE
    cache = {}

    def tables(device):
        if device not in cache:
            cache[device] = (torch.tensor(_MIDPOINTS, device=device),
                             torch.tensor(_TABLE, device=device))
        return cache[device]

    def compress(x):
        mid, _ = tables(x.device)
        m = x.abs().max()
        idx = torch.bucketize(x.abs() / m, mid)
        return (idx | ((x < 0).to(torch.int64) << 7)).to(torch.uint8), m

    def decompress(x, payload):
        codes, m = payload
        _, table = tables(x.device)
        c = codes.to(torch.int64)
        v = table[c & 0x7F] * m
        return torch.where(c > 127, -v, v)
    return compress, decompress


def onebit():
    def compress(x):
        neg = x < 0
        mean_neg = x[neg].mean() if neg.any() else x.new_zeros(())
        mean_pos = x[~neg].mean() if (~neg).any() else x.new_zeros(())
        return neg, mean_pos, mean_neg
    return compress, (lambda x, p: torch.where(p[0], p[2], p[1]))


def signsgd():
    return (lambda x: x.sign().to(torch.int8)), (lambda x, p: p.float())


def signum(beta=0.9):
    state = {}

    def compress(x):
        m = state.setdefault("m", torch.zeros_like(x))
        m.mul_(beta).add_(x, alpha=1 - beta)
        return m.sign().to(torch.int8)
    return compress, (lambda x, p: p.float())


def efsignsgd():
    def compress(x):
        return x.sign().to(torch.int8), x.abs().sum() / x.numel()
    return compress, (lambda x, p: p[0].float() * p[1])


def topk(ratio=RATIO):
    def compress(x):
        k = max(1, math.ceil(ratio * x.numel()))
        idx = torch.topk(x.abs(), k, sorted=False).indices
        return x[idx], idx
    return _sparse(compress)


def randomk(ratio=RATIO):
    def compress(x):
        k = max(1, math.ceil(ratio * x.numel()))
        idx = torch.randperm(x.numel(), device=x.device)[:k]
        return x[idx], idx
    return _sparse(compress)


def threshold(thr=THRESHOLD):
    def compress(x):
        idx = (x.abs() > thr).nonzero().view(-1)
        return x[idx], idx
    return _sparse(compress)


def dgc(ratio=RATIO):
    def compress(x):
        n = x.numel()
        k = max(1, math.ceil(ratio * n))
        sample = x.abs()[torch.randint(0, n, (max(1, n // 100),), device=x.device)]
        thr = torch.topk(sample, max(1, math.ceil(ratio * sample.numel()))).values.min()
        idx = (x.abs() >= thr).nonzero().view(-1)
        if idx.numel() > k:
            idx = idx[torch.topk(x.abs()[idx], k, sorted=False).indices]
        return x[idx], idx
    return _sparse(compress)


def adaq(ratio=RATIO):
    def compress(x):
        pos, neg = (x > 0).nonzero().view(-1), (x < 0).nonzero().view(-1)
        kp = max(1, math.ceil(ratio * pos.numel()))
        kn = max(1, math.ceil(ratio * neg.numel()))
        ip = pos[torch.topk(x[pos], kp).indices]
        ineg = neg[torch.topk(-x[neg], kn).indices]
        return ip, ineg, x[ip].mean(), x[ineg].mean()

    def decompress(x, p):
        out = torch.zeros_like(x)
        out[p[0]] = p[2]
        out[p[1]] = p[3]
        return out
    return compress, decompress


def inceptionn(bound=2.0**-10):
    d = 2.0 ** math.floor(math.log2(bound))

    def compress(x):
        q = x.abs() / d
        tag = (q >= 1).to(torch.uint8) + (q >= 128).to(torch.uint8) + (q >= 32768).to(torch.uint8)
        return tag, (x[tag == 1] / d).to(torch.int8), (x[tag == 2] / d).to(torch.int16), \
            x[tag == 3]

    def decompress(x, p):
        tag, v1, v2, v3 = p
        out = torch.zeros_like(x)
        out[tag == 1] = v1.float() * d
        out[tag == 2] = v2.float() * d
        out[tag == 3] = v3
        return out
    return compress, decompress


def sketch(q=64, sample=16384):
    def compress(x):
        picks = x[torch.randint(0, x.numel(), (sample,), device=x.device)]
        edges = torch.quantile(picks, torch.linspace(0, 1, q + 1, device=x.device)[1:-1])
        bucket = torch.bucketize(x, edges)
        sums = torch.zeros(q, device=x.device).scatter_add_(0, bucket, x)
        counts = torch.bincount(bucket, minlength=q).float()
        return bucket.to(torch.uint8), sums / counts.clamp(min=1)
    return compress, (lambda x, p: p[1][p[0].long()])


def powersgd(rank=1):
    def compress(x):
        m = x.view(int(math.sqrt(x.numel())), -1)
        q = torch.randn(m.shape[1], rank, device=x.device)
        p, _ = torch.linalg.qr(m @ q)
        return p, m.t() @ p
    return compress, (lambda x, pq: (pq[0] @ pq[1].t()).view(-1))


def none():
    return (lambda x: x), (lambda x, p: p)


METHODS = {f.__name__: f for f in (none, fp16, bf16, qsgd, terngrad, natural, u8bit, onebit,
                                   signsgd, signum, efsignsgd, topk, randomk, threshold, dgc,
                                   adaq, inceptionn, sketch, powersgd)}
