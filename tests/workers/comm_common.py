"""Shared by the communicator workers and tests: the deterministic per-rank inputs, the
(communicator, compressor) pairs to run, and a single-process reference that replays every
rank's compress / decompress / aggregate for each communicator's math.

The reference is written from the communicators' documented behaviour, independently of their
code: it never touches a collective, it keeps one compressor and one memory per simulated rank,
and it reduces in rank order with NumPy-free framework arithmetic.
"""

from __future__ import annotations

import os

import numpy as np

from grace_dl.backend import ops_for
from grace_dl.compressors.base import Call
from grace_dl.registry import BUILTIN, lookup

STEPS = 2
MEMORY = "residual"
# name -> shape. "b" has fewer elements than 4 ranks (two-phase edge case), "w" does not split
# evenly over 4 ranks, "quiet" is zero on every rank but 0 (threshold sends nothing there),
# "big" is large enough for the byte-count bounds to be meaningful.
TENSORS = {"w": (5, 7), "b": (3,), "quiet": (6,), "big": (64, 64)}


def make_input(rank: int, step: int, name: str) -> np.ndarray:
    shape = TENSORS[name]
    if name == "quiet" and rank > 0:
        return np.zeros(shape, np.float32)
    index = list(TENSORS).index(name)
    return np.random.default_rng([rank, step, index]).standard_normal(shape).astype(np.float32)


def compressor_names():
    """(names that import and construct with defaults, {name: error} for the others)."""
    ok, missing = [], {}
    for name in sorted(BUILTIN["compressor"]):
        try:
            lookup("compressor", name)()
        except Exception as err:  # noqa: BLE001 - reported by the test
            missing[name] = f"{type(err).__name__}: {err}"
            continue
        ok.append(name)
    return ok, missing


def pairs(communicators):
    """Every (communicator, compressor) pair where the communicator accepts the compressor."""
    ok, _ = compressor_names()
    out = []
    for comm in communicators:
        cls = lookup("communicator", comm)
        for comp in ok:
            if cls.refusal(lookup("compressor", comp)()) is None:
                out.append((comm, comp))
    return out


def build(comm: str, comp: str):
    """A fresh communicator; ``GRACE_TEST_PACK_PARTS=0`` builds those that pack a payload's
    parts into one collective (allgather, broadcast, two-phase) with ``pack_parts=False``."""
    kwargs = {}
    if comm in ("allgather", "broadcast", "twophase") \
            and os.environ.get("GRACE_TEST_PACK_PARTS") == "0":
        kwargs["pack_parts"] = False
    return lookup("communicator", comm)(lookup("compressor", comp)(), lookup("memory", MEMORY)(),
                                        **kwargs)


# ------------------------------------------------------------------ the reference
class SimRank:
    """One simulated rank: its own compressor and memory, as a real rank has, and its rank
    (the stream of its quantizers' dither)."""

    def __init__(self, comp: str, rank: int = 0):
        self.compressor = lookup("compressor", comp)()
        self.call = Call(rank=rank)
        self.memory = lookup("memory", MEMORY)()

    def compress(self, x, name):
        compensated = self.memory.compensate(x, name)
        payload, ctx = self.compressor.compress(compensated, name, self.call)
        self.memory.update(compensated, name, self.compressor, payload, ctx)
        return payload, ctx


def _sum(ts):
    total = ts[0]
    for t in ts[1:]:
        total = total + t
    return total


def _finish(total, size, compressor, op):
    return total / size if op == "average" and compressor.caps.average else total


def reference_allreduce(ranks, xs, name, op):
    """Sum every payload part over ranks, decompress once. Multi-round compressors continue
    with ``next_round`` on the summed payload; their memories are then updated with the final
    summed payload through a decompress that averages over ranks. Returns the output and rank
    0's payload of each round."""
    comp = ranks[0].compressor
    size = len(ranks)
    if comp.caps.rounds == 1:
        sent = [r.compress(x, name) for r, x in zip(ranks, xs)]
    else:
        compensated = [r.memory.compensate(x, name) for r, x in zip(ranks, xs)]
        sent = [r.compressor.compress(c, name, r.call) for r, c in zip(ranks, compensated)]
    rounds = [sent[0][0]]
    while True:
        summed = [_sum([p[i] for p, _ in sent]) for i in range(len(sent[0][0]))]
        following = [r.compressor.next_round(summed, c) for r, (_, c) in zip(ranks, sent)]
        if following[0] is None:
            break
        sent = following
        rounds.append(sent[0][0])
    if comp.caps.rounds > 1:
        for r, c, (_, ctx) in zip(ranks, compensated, sent):
            r.memory.update(c, name, _Mean(r.compressor, size), summed, ctx)
    return _finish(comp.decompress(summed, sent[0][1]), size, comp, op), rounds


class _Mean:
    def __init__(self, compressor, size):
        self.compressor, self.size = compressor, size

    def decompress(self, payload, ctx):
        return self.compressor.decompress(payload, ctx) / self.size

    def __getattr__(self, attr):
        return getattr(self.compressor, attr)


def reference_gather(ranks, xs, name, op):
    """allgather and broadcast: every payload decompressed (with its own rank's ctx, which a
    correct compressor makes equal to any other rank's), aggregated in rank order."""
    comp = ranks[0].compressor
    sent = [r.compress(x, name) for r, x in zip(ranks, xs)]
    out = comp.aggregate([r.compressor.decompress(p, c) for r, (p, c) in zip(ranks, sent)])
    return _finish(out, len(ranks), comp, op), sent


class _Chunks:
    """A compressor view over a chunk-split tensor, for the memory's update."""

    def __init__(self, compressor, shape):
        self.compressor, self.shape = compressor, shape

    def sent_entries(self, payloads, ctxs):
        return None  # dense: the memory subtracts the joined decompressions

    def decompress(self, payloads, ctxs):
        parts = [self.compressor.decompress(p, c) for p, c in zip(payloads, ctxs)]
        return ops_for(parts[0]).reshape(ops_for(parts[0]).cat(parts), self.shape)


def reference_twophase(ranks, xs, name, op, servers):
    """Scatter-reduce then gather over chunks; ``servers[j]`` is rank j's server-side residual
    store (a dict name -> tensor) for the chunk it owns. Returns the result, every rank's chunk
    payloads and every owner's re-compressed payload."""
    size = len(ranks)
    ops = ops_for(xs[0])
    numel = ops.numel(xs[0])
    m = min(size, numel)
    sizes = [numel // m + (1 if j < numel % m else 0) for j in range(m)]
    chunk_payloads = []
    for r, x in zip(ranks, xs):
        compensated = r.memory.compensate(x, name)
        chunks = ops.split(ops.flatten(compensated), sizes)
        comp = [r.compressor.compress(c, f"{name}/chunk{j}", r.call)
                for j, c in enumerate(chunks)]
        r.memory.update(compensated, name, _Chunks(r.compressor, ops.shape(x)),
                        [p for p, _ in comp], [c for _, c in comp])
        chunk_payloads.append(comp)
    pieces, recompressed = [], []
    for j in range(m):
        server = ranks[j]
        ctx_j = chunk_payloads[j][j][1]
        reduced = server.compressor.aggregate(
            [server.compressor.decompress(chunk_payloads[r][j][0], ctx_j) for r in range(size)])
        key = f"{name}/chunk{j}"
        residual = servers[j].get(key)
        compensated = reduced if residual is None else reduced + residual
        p2, c2 = server.compressor.compress(compensated, f"{name}/chunk{j}/server", server.call)
        servers[j][key] = compensated - server.compressor.decompress(p2, c2)
        pieces.append(server.compressor.decompress(p2, ctx_j))
        recompressed.append(p2)
    out = ops.reshape(ops.cat(pieces), ops.shape(xs[0]))
    return _finish(out, size, ranks[0].compressor, op), chunk_payloads, recompressed
