"""PowerSGD's bucket path in the DDP hook: a bucket's gradients compensated, compressed,
reduced and decompressed a round at a time with a few torch operations per bucket and matrix
shape, and one product per matrix and round, instead of the reference composition's calls
per tensor.

The reference (``Allreduce`` carrying each parameter as its own grace tensor, each round of a
bucket fused into one collective per dtype by ``GroupCollectives``) runs every tensor through
``Router.send`` and ``receive_all``: a handle, phases, recorded collective calls, byte counts
and an average per tensor and round. On a GPU that host work is what the step waits for (a
DDP bucket compresses in less time than its Python), so this path does per bucket what
PyTorch's ``powerSGD_hook`` does, with fewer launches:

- **the first round**: every residual compensated by one ``_foreach_add_``; each compressed
  tensor's warm-start Q read for all tensors of a matrix shape at once (stacked, its zero
  columns refilled from the first draw in one ``where``); each P = M Q written by its product
  straight into the bucket's first-round buffer, the uncompressed tensors copied there by one
  ``_foreach_copy_``; that buffer summed in place (one allreduce a bucket).
- **the second round**: the summed Ps orthonormalized together per matrix shape (one batched
  QR, as ``powerSGD_hook`` with ``batch_tensors_with_same_shape``); each Q_w^T = P_hat^T M
  a tensor of its own (a CPU BLAS may round a product by its output's alignment: so it is the
  reference's), joined into the second-round buffer, which is summed while this rank's
  residuals M - P_hat Q_w^T are written.
- **results**: the uncompressed tensors' sums copied into DDP's bucket and averaged by two
  foreach operations; each P_hat Q^T multiplied straight into its gradient (the average folded
  into Q: one division of the second-round buffer); the reduced Qs kept as the next warm start
  by one ``_foreach_copy_``.

A bucket's layout (which tensors are matrices, where each sits in the two buffers, its matrix
shape groups, its byte counts and units) is worked out once per DDP bucket layout (and, with
``start_step``, per set of tensors compressed that step) and kept (``_Plan``; no tensor in it).

**Chosen once**, when the ``GraceState`` is built (``serves``): per-parameter granularity and
grace's own ``Allreduce`` (its exact class, no fusion groups) carrying its own
``PowerSGDCompressor`` with memory ``powersgd``; anything else (a subclass, another memory)
takes the reference; so does, bucket by bucket, a bucket whose gradients are not its buffer in
row-major order or whose state is in another dtype or on another device (``_layout``).
**Same bits** as the reference composition on the CPU: the same products
(``ops.assign_matmul``, ``ops.assign_sub_matmul``: the reference's), the same sums, divisions
and QR factorizations per matrix (LAPACK factors a batch one matrix at a time), the same state
under the same keys (``tests/test_ddp_powersgd.py`` compares every parameter and slot with the
reference's on a model with repeated shapes, both ops and PowerSGD's options;
``tests/test_ddp.py`` trains both on 3 ranks). On a GPU a batched QR may round otherwise than
one matrix at a time (cuSOLVER or cuBLAS's batched kernels). **Same wire**: per bucket one
allreduce of its Ps and uncompressed tensors in the bucket's order, then one of its Q^Ts, as
the reference's fused rounds (and ``powerSGD_hook``) send; the same bytes counted per tensor
name in ``grc.bytes``. A DDP bucket holds gradients of one dtype and device (DDP's reducer
groups them so); a bucket of mixed dtypes is refused (ValueError naming them).
"""

from __future__ import annotations

import torch

from grace_dl.communicators.allreduce import Allreduce
from grace_dl.communicators.base import AVERAGE
from grace_dl.communicators.exchange import Unit
from grace_dl.communicators.wire import ring_allreduce_bytes
from grace_dl.compressors.powersgd import EPSILON, PowerSGDCompressor
from grace_dl.memory.powersgd import PowerSGDFeedback
from grace_dl.torch import ops

_NARROW = (torch.float16, torch.bfloat16)
#: plans kept per path: a few DDP layouts (its first iteration's and the rebuilt one's) and,
#: with ``start_step``, a few sets of compressed tensors
_PLANS_KEPT = 64


class _Plan:
    """One bucket layout as the path sends it (module docstring); holds no tensor.

    ``low``: positions (in the bucket) of the tensors compressed, ``dense``: of those sent
    uncompressed, ``whole``: of those among them compensated in a residual slot all the same
    (with ``start_step``, the compressible ones still sent whole); ``shapes``: each compressed
    tensor's (n, m, r); ``groups``: (indices into ``low``) per matrix shape; ``p_sizes`` /
    ``q_sizes``: each tensor's length in the first / second round's buffer (bucket order /
    ``low``'s order)."""

    __slots__ = ("names", "numels", "low", "dense", "whole", "shapes", "groups", "p_sizes",
                 "q_sizes", "p_numel", "res_keys", "q_keys", "q0_keys",
                 "whole_keys", "tensor_shapes", "units", "moved", "narrow")

    def __init__(self, compressor, bucket, names, numels, compressible, low):
        grads = bucket.gradients()
        self.names, self.numels, self.low = names, list(numels), low
        self.narrow = grads[0].dtype in _NARROW
        self.tensor_shapes = [g.shape for g in grads]
        low_set = set(low)
        self.dense = tuple(i for i in range(len(grads)) if i not in low_set)
        self.shapes = [compressor.matrix_shape(tuple(grads[i].shape)) for i in low]
        # compressible tensors sent whole this step (start_step) still add into their slots
        self.whole = tuple(i for i in compressible if i not in low_set)
        self.whole_keys = [names[i] for i in self.whole]
        groups: dict = {}
        for j, shape in enumerate(self.shapes):
            groups.setdefault(shape, []).append(j)
        self.groups = [(shape, tuple(js)) for shape, js in groups.items()]
        p_sizes = list(self.numels)
        for i, (n, _, r) in zip(low, self.shapes):
            p_sizes[i] = n * r
        self.p_sizes, self.q_sizes = p_sizes, [r * m for _, m, r in self.shapes]
        self.p_numel = sum(self.p_sizes)
        self.res_keys = [names[i] for i in low]
        self.q_keys = [f"q/{names[i]}" for i in low]
        self.q0_keys = [f"q0/{names[i]}" for i in low]
        self.units = []
        for name in names:
            unit = Unit(name, [name], None, None, [], None, None)
            unit.lands = True       # (its result is written into DDP's bucket)
            self.units.append(unit)
        self.moved = None           # (size, (name, bytes) per round) for the group's size

    def count(self, coll, size: int, dtype) -> tuple:
        """What each round moves per tensor name over ``size`` ranks, as ``Allreduce`` counts
        it (worked out again when the hook's group has another size)."""
        if self.moved is None or self.moved[0] != size:

            def moved(numel):
                return ring_allreduce_bytes(coll.allreduce_nbytes(
                    torch.empty(numel, dtype=dtype, device="meta")), size)
            self.moved = (size, [(n, moved(s)) for n, s in zip(self.names, self.p_sizes)],
                          [(self.names[i], moved(s)) for i, s in zip(self.low, self.q_sizes)])
        return self.moved[1:]


class _Bucket:
    """A bucket in flight: its plan, DDP's buffer split into its gradients, and what the
    rounds keep of each compressed tensor (its M, P_hat, Q_w^T, Q slot, gradient as a
    matrix)."""

    __slots__ = ("plan", "grads", "coll", "size", "label", "pending", "matrices", "outs",
                 "p_hats", "qt_local", "q_slots")

    def __init__(self, plan, grads, coll, label):
        self.plan, self.grads, self.coll, self.label = plan, grads, coll, label
        self.size = coll.size()
        self.pending = self.matrices = self.outs = self.p_hats = None
        self.qt_local = self.q_slots = None


class PowerSGDBuckets:
    """The bucket path of ``grace`` (``serves``) for a hook of ``op``."""

    @staticmethod
    def serves(grace) -> bool:
        """Whether ``grace`` is exactly what this path reproduces (module docstring)."""
        return (type(grace) is Allreduce and grace.fusion is None
                and type(grace.compressor) is PowerSGDCompressor
                and type(grace.feedback) is PowerSGDFeedback)

    def __init__(self, grace, op: str):
        self.grace = grace
        self.compressor, self.memory = grace.compressor, grace.feedback.memory
        self.average = op == AVERAGE and grace.compressor.caps.average
        self._plans: dict = {}
        self._layouts: dict = {}    # (names, dtype, device) -> ``_layout``

    def __getstate__(self) -> dict:
        """Picklable with its ``GraceState``; the plans (byte counts of this job's size) are
        worked out again by the copy."""
        state = dict(self.__dict__)
        state["_plans"], state["_layouts"] = {}, {}
        return state

    # ------------------------------------------------------------------ the layout
    def _plan(self, bucket, names, numels) -> _Plan | None:
        """The bucket's plan for this step; None where the bucket takes the reference
        (``_layout``)."""
        compressor = self.compressor
        buffer = bucket.buffer()
        key = (names, buffer.dtype, buffer.device)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= _PLANS_KEPT:
                self._layouts.clear()
            layout = self._layouts[key] = self._layout(bucket, names)
        if layout is None:
            return None
        low = compressible = layout
        if compressor.start_step > 0:   # which are compressed this step: their counters
            low = tuple(i for i in low
                        if compressor.next_step(names[i], buffer) > compressor.start_step)
            key = (key, low)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            plan = self._plans[key] = _Plan(compressor, bucket, names, numels, compressible,
                                            low)
        return plan

    def _layout(self, bucket, names) -> tuple | None:
        """The positions of the bucket's tensors PowerSGD compresses (once started); None
        where the bucket takes the reference composition: a gradient that is not its stretch
        of DDP's buffer in row-major order (DDP's hook views always are, ``channels_last``
        parameters' too), or state kept in another dtype or on another device than the
        bucket's (a model moved or cast under the same ``GraceState``: the reference's
        operations mix them, the path's products into its buffers cannot)."""
        grads, buffer = bucket.gradients(), bucket.buffer()
        dtypes = {g.dtype for g in grads}
        if len(dtypes) > 1:
            raise ValueError(f"a DDP bucket holds gradients of one dtype; bucket of "
                             f"{list(names)} has {sorted(map(str, dtypes))}")
        base, offset, itemsize = buffer.data_ptr(), 0, buffer.element_size()
        for g in grads:
            if not g.is_contiguous() or g.data_ptr() != base + offset * itemsize:
                return None
            offset += g.numel()
        if offset != buffer.numel() or not buffer.is_contiguous():
            return None
        low = tuple(i for i, g in enumerate(grads)
                    if not self.compressor.never_compresses(ops, g))
        kept = [self.memory.state.existing([names[i]]) for i in low] + \
            [self.compressor.state.existing([f"{p}/{names[i]}"]) for i in low
             for p in ("q", "q0")]
        if any(k is not None and (k[0].dtype != buffer.dtype or k[0].device != buffer.device)
               for k in kept):
            return None
        return low

    @staticmethod
    def _slots(state, keys, make):
        """The slots of ``keys`` (``make(i)`` creates the i-th where one does not exist yet:
        the first step, or a restored state)."""
        slots = state.existing(keys)
        return slots if slots is not None else [make(i) for i in range(len(keys))]

    # ------------------------------------------------------------------ the first round
    def start(self, bucket, names, numels, coll, label: str) -> _Bucket | None:
        """Compensate and compress DDP's ``bucket`` (its gradients named ``names``, of
        ``numels`` elements) and start the first round's allreduce (``Communicator.encode``
        and ``Allreduce.issue``). None where the bucket takes the reference composition
        (``_layout``; nothing done, no step counted)."""
        compressor, state = self.compressor, self.memory.state
        names = tuple(names)
        plan = self._plan(bucket, names, numels)
        if plan is None:
            return None
        buffer = bucket.buffer()
        grads = buffer.split(plan.numels)
        out = _Bucket(plan, grads, coll, label)
        flat = torch.empty(plan.p_numel, dtype=buffer.dtype, device=buffer.device)
        parts = flat.split(plan.p_sizes)
        if plan.whole_keys:     # (start_step: compressible, sent whole from its slot)
            whole, shaped = plan.whole, plan.tensor_shapes
            slots = [state.zeros(k, ops, grads[i].view(shaped[i])).view(-1)
                     for k, i in zip(plan.whole_keys, whole)]
            torch._foreach_add_(slots, [grads[i] for i in whole])
            sources = dict(zip(whole, slots))
            torch._foreach_copy_([parts[i] for i in plan.dense],
                                 [sources.get(i, grads[i]) for i in plan.dense])
        elif plan.dense:
            torch._foreach_copy_([parts[i] for i in plan.dense], [grads[i] for i in plan.dense])
        if plan.low:
            low, shapes = plan.low, plan.shapes
            outs = [grads[i].view(n, m) for i, (n, m, _) in zip(low, shapes)]
            residuals = self._slots(state, plan.res_keys, lambda j: state.zeros(
                plan.res_keys[j], ops, grads[low[j]].view(plan.tensor_shapes[low[j]])))
            matrices = [e.view(n, m) for e, (n, m, _) in zip(residuals, shapes)]
            torch._foreach_add_(matrices, outs)         # M = g + e, in the residual's slot
            q_slots = self._slots(compressor.state, plan.q_keys, lambda j: compressor._q_slot(
                ops, names[low[j]], shapes[j][1:], outs[j]))
            q0_slots = self._slots(compressor.state, plan.q0_keys, lambda j: compressor._q_slot(
                ops, names[low[j]], shapes[j][1:], outs[j], "q0"))
            for (_, _, r), js in plan.groups:
                qs = _stacked([q_slots[j] for j in js])
                warm = torch.where(torch.linalg.vector_norm(qs, dim=-2, keepdim=True) > 0, qs,
                                   _stacked([q0_slots[j] for j in js]))
                if plan.narrow:
                    warm = _orthonormal(warm, r)
                for j, q in zip(js, _each(warm, js)):
                    n, _, r = shapes[j]
                    ops.assign_matmul(parts[low[j]].view(n, r), matrices[j], q)
            out.matrices, out.outs, out.q_slots = matrices, outs, q_slots
        out.pending = self._allreduce(flat, plan.count(coll, out.size, buffer.dtype)[0], coll,
                                      label + ".p")
        return out

    # ------------------------------------------------------------------ the second round, results
    def exchange(self, buckets) -> list:
        """Finish ``buckets`` (started by ``start``, in the same order on every rank) in
        lockstep, as ``Router.receive_all`` does: every bucket's second round is started
        before any is waited for. Their results are in DDP's buckets; returns the step's
        units (one per gradient, named as the reference names them)."""
        for bucket in buckets:      # first round: the summed Ps (and the uncompressed tensors)
            plan, grads = bucket.plan, bucket.grads
            parts = bucket.coll.synchronize(bucket.pending).split(plan.p_sizes)
            if plan.dense:
                dense = [grads[i] for i in plan.dense]
                torch._foreach_copy_(dense, [parts[i] for i in plan.dense])
                if self.average:
                    torch._foreach_div_(dense, bucket.size)
                if plan.whole_keys:     # sent whole (start_step): nothing lost
                    torch._foreach_zero_(self.memory.state.existing(plan.whole_keys))
            bucket.pending = None
            if not plan.low:
                continue
            low, shapes = plan.low, plan.shapes
            p_hats = [None] * len(low)
            for (n, _, r), js in plan.groups:
                summed = _stacked([parts[low[j]].view(n, r) for j in js])
                for j, p_hat in zip(js, _each(_orthonormal(summed, r), js)):
                    p_hats[j] = p_hat
            # P^T M (``next_round``: not M^T P), each a tensor of its own as the reference's:
            # a CPU BLAS may round a product by where its output lies (MKL: by the output's
            # 16-byte alignment), so written into the round's buffer it would not be the
            # reference's; then joined into that buffer (which the sum overwrites)
            qts = [ops.matmul(p_hat.t(), matrix) for p_hat, matrix in zip(p_hats, bucket.matrices)]
            bucket.p_hats, bucket.qt_local = p_hats, qts
            bucket.pending = self._allreduce(torch.cat([qt.view(-1) for qt in qts]),
                                             plan.count(bucket.coll, bucket.size,
                                                        grads[0].dtype)[1],
                                             bucket.coll, bucket.label + ".q")
        for bucket in buckets:      # second round: the summed Q^Ts
            plan = bucket.plan
            if not plan.low:
                continue
            shapes, p_hats, matrices = plan.shapes, bucket.p_hats, bucket.matrices
            for matrix, p_hat, qt in zip(matrices, p_hats, bucket.qt_local):
                # this rank's share is known: the residual, meanwhile
                ops.assign_sub_matmul(matrix, p_hat, qt)
                ops.assign_finite(matrix)   # (a NaN/Inf is sent once, never kept)
            summed = bucket.coll.synchronize(bucket.pending)
            sums = [q.view(r, m) for q, (_, m, r) in zip(summed.split(plan.q_sizes), shapes)]
            # the reduced Q (the sum) is the next warm start
            torch._foreach_copy_(bucket.q_slots, [q.t() for q in sums])
            if self.average:        # the average folded into Q (``PowerSGDPath.divided``)
                sums = [q.view(r, m) for q, (_, m, r) in
                        zip((summed / bucket.size).split(plan.q_sizes), shapes)]
            for out, p_hat, q in zip(bucket.outs, p_hats, sums):
                ops.assign_matmul(out, p_hat, q)
            bucket.pending = bucket.matrices = bucket.p_hats = bucket.qt_local = None
            bucket.outs = bucket.q_slots = None
        return [unit for bucket in buckets for unit in bucket.plan.units]

    def _allreduce(self, flat, moved, coll, name: str):
        """Start the sum of ``flat`` (one round's buffer of a bucket) in place and count each
        tensor's bytes (``moved``) as ``Allreduce`` counts them."""
        self.grace.bytes.add_each(moved)
        wire = f"grace.ddp.{name}.{str(flat.dtype).removeprefix('torch.')}"
        handle = coll.allreduce_async_(flat, wire)
        return handle if handle is not None else coll.allreduce_async(flat, wire)


def _stacked(matrices):
    """``matrices`` (of one shape) as one batch: the one itself, or their stack."""
    return matrices[0] if len(matrices) == 1 else torch.stack(matrices)


def _each(batch, js):
    """The matrices of ``batch`` (``_stacked``'s, of ``len(js)`` matrices)."""
    return (batch,) if len(js) == 1 else batch.unbind(0)


def _orthonormal(batch, r: int):
    """``compressors.powersgd.orthonormalize`` of each matrix of ``batch`` (k x r, or a
    batch B x k x r), in one call: Householder QR's Q, or one column divided by max(its
    norm, EPSILON); in float32 for 16-bit inputs."""
    work = batch.float() if batch.dtype in _NARROW else batch
    if r == 1:
        out = work / torch.clamp(torch.linalg.vector_norm(work, dim=(-2, -1), keepdim=True),
                                 min=EPSILON)
    else:
        out = torch.linalg.qr(work)[0]
    return out.to(batch.dtype) if work is not batch else out
