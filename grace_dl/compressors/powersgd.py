"""``powersgd``: rank-r gradient compression by one step of subspace (power) iteration per
training step, warm-started from the previous step (Vogels, Karimireddy & Jaggi 2019,
"PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS).

Each gradient is viewed as an n x m matrix ``M`` (n = output units, see *Matricization*) and sent
as two dense factors in two allreduce rounds (r = min(compress_rank, n, m)):

1. ``compress``:   P = M Q, with Q (m x r) this tensor's warm-start matrix (the previous step's
   reduced Q; see ``_warm_q``).
   **The first allreduce sends P: n x r elements** of the gradient's dtype; the wire **sums**
   the P of all ranks.
2. ``next_round``: P_hat = orthonormalize(sum of P), Q_w = M^T P_hat.
   **The second sends Q_w^T = P_hat^T M: r x m elements** (row-major as computed, so nothing
   is copied to flatten it); the wire sums them.
3. ``decompress``: P_hat (sum_w Q_w)^T, reshaped to the gradient's shape and dtype. This is the
   *sum* of every rank's share P_hat Q_w^T, so the communicator's ``op=average`` division by the
   number of ranks yields the paper's average P_hat Q_avg^T. The reduced Q becomes the next
   step's warm start (kept in ``self.state``, so checkpoints carry it).

Bytes: r * (n + m) * itemsize per step instead of n * m * itemsize (see
``payload_nbytes`` of the shape). Biased (a rank-r projection), so use it with error feedback:
memory ``powersgd`` keeps each rank's M - P_hat Q_w^T (the paper's Algorithm 1). Allreduce-safe:
both rounds are sums, and every rank starts from the same Q, drawn from (``seed``, name) where the
tensor lives (``ops.normal``), so every rank projects onto the same P_hat.

Uncompressed (payload ``[flat tensor]``, one round, exact): tensors with fewer than 2 axes,
integer tensors, tensors where low rank saves less than ``min_compression_rate``
(n*m / (r*(n+m)) < min_compression_rate), and the first ``start_step`` compressions of each
tensor (the hook of PyTorch's DDP, ``powerSGD_hook.py``, does the same: early training is
sensitive to compression error).

Matricization: the output axis becomes the rows, the other axes the columns, in the same column
order for both frameworks. torch layouts (Linear (out, in); conv (O, I, *spatial)) are reshaped
as they are; Keras layouts (Dense (in, out); conv (*spatial, I, O)) are permuted to
(O, I, *spatial) first, so the same logical kernel gives the same matrix, and the same result,
in both frameworks.

Orthonormalization (of P only, as in the paper) is one Householder QR (``orthonormalize``):
Gram–Schmidt's columns up to their signs, which the results do not depend on; an all-zero
layer stays finite (result 0). A column of the warm-start Q that became zero (the layer was
zero) or NaN is refilled from the initial draw, so the iteration never gets stuck in a
smaller subspace. 16-bit inputs are orthonormalized in float32.

``tf.function``: works, with static tensor shapes; the step counter is then a graph tensor, so
``start_step > 0`` (a per-step choice between payloads of different shapes) raises ValueError
there: run the first ``start_step`` steps eagerly or use ``start_step=0`` in graph mode.
"""

from __future__ import annotations

from itertools import repeat

from grace_dl import dtypes
from grace_dl.backend import ops_for
from grace_dl.compressors import paths
from grace_dl.compressors.base import LOCAL, Capabilities, Compressor
from grace_dl.registry import register_compressor
from grace_dl.validate import in_range, one_of
from grace_dl.validate import seed as check_seed

EPSILON = 1e-20
LAYOUTS = ("torch", "tensorflow")


class _Ctx:
    """What one tensor's compression keeps locally between rounds (never sent); ``ops``: its
    backend, found once in ``compress``."""

    __slots__ = ("ops", "name", "shape", "low_rank", "matrix", "p_hat", "qt_local")

    def __init__(self, ops, name, shape, low_rank, matrix=None):
        self.ops = ops
        self.name = name
        self.shape = shape
        self.low_rank = low_rank
        self.matrix = matrix
        self.p_hat = None
        self.qt_local = None


@register_compressor("powersgd")
class PowerSGDCompressor(Compressor):
    """PowerSGD (see the module docstring for the wire format and its properties).

    ``compress_rank``: r, the rank of the approximation (1 compresses most; the paper uses 1-4,
    more for NLP). ``min_compression_rate``: compress a tensor only if
    n*m / (r*(n+m)) >= this. ``start_step``: the first ``start_step`` compressions of each
    tensor go uncompressed. ``seed``: keys the initial Q, identical on every rank.
    """

    caps = Capabilities(allreduce_safe=True, rounds=2, needs_shape=True)

    def __init__(self, compress_rank: int = 1, min_compression_rate: float = 2.0,
                 start_step: int = 0, seed: int = 0):
        seed = check_seed(seed)
        super().__init__(seed)
        self.compress_rank = in_range("compress_rank", compress_rank, 1, None, kind=int)
        self.min_compression_rate = in_range("min_compression_rate", min_compression_rate,
                                             0.0, None)
        self.start_step = in_range("start_step", start_step, 0, None, kind=int)

    # ------------------------------------------------------------------ planning
    def matrix_shape(self, shape, layout: str = "torch"):
        """(n, m, r) of the matrix a tensor of ``shape`` (in ``layout``) is compressed as, or
        ``None`` when it goes uncompressed whatever the step."""
        shape = tuple(shape)
        if len(shape) < 2:
            return None
        n = shape[0] if layout == "torch" else shape[-1]
        m = 1
        for d in shape:
            m *= d
        m = m // n if n else 0
        r = min(self.compress_rank, n, m)
        if r == 0 or n * m < self.min_compression_rate * r * (n + m):
            return None
        return n, m, r

    def never_compresses(self, ops, tensor) -> bool:
        """Whether ``tensor`` (a backend tensor) goes uncompressed at every step."""
        return not ops.is_floating(tensor) or self.matrix_shape(ops.shape(tensor),
                                                                ops.NAME) is None

    def payload_nbytes(self, size, dtype="float32", layout="torch"):
        """Bytes one rank sends for a tensor of shape ``size`` over both rounds once
        compression has started: r*(n+m)*itemsize, or n*m*itemsize for a tensor that goes
        uncompressed; ``None`` for a number of elements (the bytes depend on the matrix
        shape). ``layout`` ("torch" or "tensorflow") says which axis is the output one."""
        if isinstance(size, int):
            return None
        one_of("layout", layout, LAYOUTS)
        itemsize = dtypes.itemsize(dtype)
        plan = self.matrix_shape(size, layout)
        if plan is None:
            numel = 1
            for d in size:
                numel *= d
            return numel * itemsize
        n, m, r = plan
        return r * (n + m) * itemsize

    # ------------------------------------------------------------------ the three phases
    def compress(self, tensor, name, call=LOCAL):
        ops = ops_for(tensor)
        shape = ops.shape(tensor)
        if not all(map(isinstance, shape, repeat(int))):    # (static: no frame per axis)
            raise ValueError(f"powersgd needs a static shape for tensor {name!r}, got {shape}")
        plan = self.matrix_shape(shape, ops.NAME) if ops.is_floating(tensor) else None
        if plan is not None and self.start_step > 0:
            step = self.next_step(name, tensor)
            if ops.is_tensor(step):
                raise ValueError(
                    f"powersgd start_step={self.start_step} cannot be used inside tf.function "
                    f"(tensor {name!r}): the step is a graph tensor there; use start_step=0 or "
                    f"run the first {self.start_step} steps eagerly")
            if step <= self.start_step:
                plan = None
        if plan is None:
            return [ops.flatten(tensor)], _Ctx(ops, name, shape, False)
        n, m, r = plan
        matrix = self._to_matrix(ops, tensor, n, m)
        q = self._warm_q(ops, name, m, r, tensor)
        return [ops.matmul(matrix, q)], _Ctx(ops, name, shape, True, matrix)

    def next_round(self, reduced, ctx):
        """The first allreduce's result (the summed P): orthonormalize it and return
        ``[Q_w^T]`` to reduce. The second's (the summed Q^T), or an uncompressed tensor:
        ``None``."""
        if not ctx.low_rank or ctx.p_hat is not None:
            return None
        ops = ctx.ops
        ctx.p_hat = orthonormalize(ops, reduced[0])
        # P^T M, not M^T P: transposing M costs a pass over it (TensorFlow copies it; torch's
        # CPU GEMM strides across it, 40x slower for 2048 x 2048); sent as it comes, r x m,
        # so that nothing is copied to flatten it
        ctx.qt_local = ops.matmul(ops.transpose(ctx.p_hat), ctx.matrix)
        return [ctx.qt_local], ctx

    def decompress(self, payload, ctx):
        """P_hat (reduced Q)^T in the tensor's shape and dtype; stores the reduced Q as the
        next step's warm start. ``payload`` is the final reduced payload (the reduced Q^T)."""
        ops = ctx.ops
        if not ctx.low_rank:
            return ops.reshape(payload[0], ctx.shape)
        qt = self._keep_warm_start(ops, ctx, payload)
        return self._from_matrix(ops, ops.matmul(ctx.p_hat, qt), ctx.shape)

    def _keep_warm_start(self, ops, ctx, payload):
        """Store the reduced Q (``payload[-1]`` transposed: the sum, also in a ``divided``
        payload) as the next step's warm start (m x r); return the Q^T to multiply with
        (``payload[0]``)."""
        warm = ops.transpose(payload[-1])
        ops.assign(self._q_slot(ops, ctx.name, ops.shape(warm), warm), warm)
        return payload[0]

    def local_share(self, ctx):
        """This rank's share P_hat Q_w^T of the decompressed sum (its own contribution), shaped
        like the tensor; for error feedback (memory ``powersgd``). ``None`` when the tensor
        went uncompressed (nothing was lost)."""
        if not ctx.low_rank:
            return None
        ops = ctx.ops
        return self._from_matrix(ops, ops.matmul(ctx.p_hat, ctx.qt_local), ctx.shape)

    def subtract_local_share(self, ctx, residual) -> bool:
        """``residual -= P_hat Q_w^T`` as rank-r updates of the residual itself, with no
        n x m product of its own (torch: a contiguous residual, as a matrix view; TensorFlow:
        a 2-D kernel, whose matrix is its transpose: ``-= Q_w P_hat^T``); else the
        plain subtraction of ``local_share``."""
        if not ctx.low_rank:
            return False
        ops = ctx.ops
        if ops.NAME == "torch":
            view = ops.flat_view(residual)
            if view is not None:
                ops.assign_sub_matmul(ops.reshape(view, ops.shape(ctx.matrix)), ctx.p_hat,
                                      ctx.qt_local)
                return True
        elif len(ctx.shape) == 2:
            ops.assign_sub_matmul(residual, ops.transpose(ctx.qt_local),
                                  ops.transpose(ctx.p_hat))
            return True
        ops.assign_sub(residual, self.local_share(ctx))
        return True

    # ------------------------------------------------------------------ helpers
    def _q_slot(self, ops, name, shape, like, key="q"):
        """The slot ``<key>/<name>`` (m x r): the warm start ``q``, or ``q0``, the initial
        draw kept to refill zero columns; both start from the initial draw."""
        m, r = shape
        return self.state.slot(f"{key}/{name}", ops,
                               lambda: self._initial_q(ops, name, m, r, like),
                               ops.dtype(like), like)

    def _initial_q(self, ops, name, m, r, like):
        """The first Q, drawn where ``like`` lives (``ops.normal``): the same on every rank."""
        return ops.normal(self.seed, name, 0, (m, r), like=like)

    def _warm_q(self, ops, name, m, r, like):
        """This step's Q: the stored (reduced) Q with zero (or NaN) columns refilled from the
        initial draw. Not orthonormalized, as in the paper's Algorithm 1: the span of
        P = M Q, which P_hat is a basis of, is the same for Q and for Q times any invertible
        upper-triangular matrix (the QR factor that would orthonormalize Q), and Q's scale
        does not grow over steps (it is M^T P_hat summed over the ranks, P_hat orthonormal).
        16-bit tensors are the exception: there Q is orthonormalized (in float32) so that
        M Q stays in range for a loss-scaled gradient."""
        q = ops.read(self._q_slot(ops, name, (m, r), like))
        q0 = ops.read(self._q_slot(ops, name, (m, r), like, "q0"))
        q = ops.where(ops.norm(q, axis=0) > 0, q, q0)
        return orthonormalize(ops, q) if ops.dtype(q) in ("float16", "bfloat16") else q

    @staticmethod
    def _to_matrix(ops, tensor, n, m):
        if ops.NAME != "torch":
            rank = len(ops.shape(tensor))
            tensor = ops.permute(tensor, _keras_to_torch(rank))
        return ops.reshape(tensor, (n, m))

    @staticmethod
    def _from_matrix(ops, matrix, shape):
        if ops.NAME == "torch":
            return ops.reshape(matrix, shape)
        rank = len(shape)
        torch_shape = tuple(shape[i] for i in _keras_to_torch(rank))
        return ops.permute(ops.reshape(matrix, torch_shape), _torch_to_keras(rank))


@paths.register(PowerSGDCompressor)
class PowerSGDPath(paths.Reference):
    """PowerSGD's own faster composition on every device: the product written into the
    output buffer, an average folded into Q."""

    def decompress_into(self, payload, ctx, out=None):
        """``decompress`` with P_hat (reduced Q)^T multiplied straight into ``out`` (the
        caller's gradient) where its memory is the matrix's (torch layout, contiguous)."""
        ops = ctx.ops
        if out is None or not ctx.low_rank or ops.NAME != "torch" or not out.is_contiguous() \
                or tuple(out.shape) != tuple(ctx.shape) or out.dtype != payload[0].dtype:
            return self.compressor.decompress(payload, ctx)
        qt = self.compressor._keep_warm_start(ops, ctx, payload)
        n, r = ops.shape(ctx.p_hat)
        ops.assign_matmul(ops.reshape(out, (n, ops.shape(qt)[1])), ctx.p_hat, qt)
        return out

    def divided(self, payload, divisor):
        """The last round's payload for the average, O((n + m) r) instead of a pass over the
        n x m result: ``[Q^T / divisor, Q^T]`` (the reduced Q^T divided, the sum itself kept
        as the next warm start, so the state is the same as after a dense division). None
        for an uncompressed tensor (its 1-D values): the communicator then divides them as
        it writes them into the output, one pass where dividing here and copying took two."""
        if len(payload[0].shape) == 1:     # (a torch or TF tensor's rank, no ops call)
            return None
        return [payload[0] / divisor, payload[0]]


def orthonormalize(ops, matrix):
    """Orthonormal columns spanning the columns of ``matrix`` (k x r, k >= r): Householder
    QR's Q (``ops.qr``: LAPACK on the CPU, cuSOLVER on a GPU; what PyTorch's powerSGD_hook
    uses), column j being what is left of column j after removing its projection on the
    columns before it, normalized, up to its sign: Gram–Schmidt's columns up to their
    signs, which PowerSGD's results do not depend on (the result is P_hat P_hat^T M, the
    residual M - P_hat Q_w^T). Where a column is zero or in the span of the ones before it,
    QR still gives a unit column orthogonal to them (a zero matrix gives unit columns; its
    product P_hat P_hat^T M is still 0). One column (rank 1) is divided by
    max(its norm, EPSILON) instead (a zero column stays zero). Computed in float32 for
    16-bit inputs."""
    dt = ops.dtype(matrix)
    work = ops.cast(matrix, "float32") if dt in ("float16", "bfloat16") else matrix
    if ops.shape(work)[1] == 1:
        out = work / ops.clamp(ops.norm(work), EPSILON)
    else:
        out = ops.qr(work)[0]
    return ops.cast(out, dt) if work is not matrix else out


def _keras_to_torch(rank):
    """Axis order taking a Keras kernel (*spatial, I, O) to torch's (O, I, *spatial)."""
    return (rank - 1, rank - 2, *range(rank - 2))


def _torch_to_keras(rank):
    """Inverse of ``_keras_to_torch``."""
    return (*range(2, rank), 1, 0)
