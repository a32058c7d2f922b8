"""``DistributedOptimizer`` with ``grace=``: Horovod's torch optimizer wrapper, with every
gradient carried by a grace_dl communicator instead of Horovod's plain allreduce.

Nothing in Horovod is patched. ``DistributedOptimizer(opt, ..., grace=None)`` returns
``horovod.torch.DistributedOptimizer(opt, ...)`` itself; with ``grace=grc`` it returns an object
of a class derived from ``type(opt)`` (as Horovod does) whose

* per-parameter hooks (``register_post_accumulate_grad_hook``) call ``grc.send(grad, name, op)``
  as soon as a gradient has been accumulated for the last of ``backward_passes_per_step`` passes,
  so compression and communication overlap the rest of the backward pass;
* ``synchronize()`` (called by ``step()`` unless inside ``skip_synchronize()``) sends what the
  hooks did not (a zero gradient for parameters that got none this step, as Horovod does, so no
  rank waits on a collective another never starts), then receives every tensor in name order,
  writes the averaged (or summed) gradient into ``p.grad`` and closes the step in
  ``grc.bytes``;
* with ``early_rounds=True`` each hook also completes, without waiting, the exchanges already
  sent whose collectives have finished (``Router.advance``): two-phase's gather and PowerSGD's
  next round start during the rest of the backward pass instead of in ``synchronize()``, and a
  finished single-round result is written into ``p.grad`` there. Same bits either way. Off by
  default: on this project's CPU-only ranks it measured no faster (``docs/DECISIONS.md``);
* ``state_dict()`` carries the grace state (error-feedback residuals, momenta, warm-start
  matrices, step counters) under the key ``"grace"``, and ``load_state_dict()`` restores it.

What differs from Horovod, and why:

* ``op``: only ``Average`` and ``Sum`` (``"average"``/``"sum"`` also accepted). Adasum, Min, Max
  and Product have no meaning for compressed payloads and raise ``ValueError``.
* ``gradient_predivide_factor=f`` (``op=Average`` only): the gradient is multiplied by ``1/f``
  before it enters the grace pipeline (memory, compressor, wire) and the aggregate by ``f``
  after ``receive`` (which already divides by the number of ranks). Error-feedback state thus
  lives in the pre-divided scale, exactly as Horovod's prescale/postscale factors wrap its sum.
* ``num_groups``/``groups`` are validated as Horovod validates them and become the
  communicator's fusion groups (``Communicator.fuse``): each tensor is still compressed on its
  own (error feedback and compressor statistics stay per tensor), and the payloads of a group
  travel in one collective per kind and dtype. ``groups=n`` splits the parameters, in name
  order, into ``n`` groups as even as possible; a list of lists of parameters names them
  (parameters in no list travel alone; tensors the optimizer does not hold, or that take no
  gradient, are left out, as Horovod leaves them). A strategy sets its groups per node instead.
* A grace object carries one optimizer: its state is keyed by parameter names, so passing
  one that another live ``DistributedOptimizer`` carries raises ``ValueError`` (Horovod's
  ``compression=`` holds no state and may be shared; build a grace object per optimizer).
* A ``UserWarning`` at construction names a pipeline known to diverge under the wrapped
  optimizer's ``momentum`` (random-k with error feedback, momentum applied twice, ...; see
  ``grace_dl.recipes``), with the recipe that works.
* ``bucket_bytes=n`` (grace only; default ``None``: one grace tensor per parameter) packs the
  gradients into flat buckets of about ``n`` bytes (``DEFAULT_BUCKET_BYTES`` is DDP's 25 MiB),
  each compressed once and sent as one grace tensor named after its members
  (``grace_dl.torch.buckets``, ``grace_dl.communicators.buckets``): one compression and one set
  of collectives per bucket, a sparsifier's k taken over the bucket. Not with ``groups`` (a
  bucket already fuses) nor with compressors that need each layer's shape (PowerSGD) or
  strategy dispatchers: a strategy names its own buckets (``AllReduceSynchronizer.bucket``,
  ``StrategyDispatcher.buckets``), which the optimizer sends the same way.
* Sparse gradients need ``sparse_as_dense=True`` (compressors work on dense tensors); without it
  a sparse gradient raises ``ValueError`` rather than silently skipping compression.
* Collectives are named after the parameters (``named_parameters``, else Horovod's
  ``allreduce.noname.<group>.<index>``), and those names also key the grace state, so a
  checkpoint restores each residual into the parameter it belongs to.
* Before the first step every rank checks (one small allgather at construction) that all
  ranks have the same grace configuration and the same parameter names and shapes; a mismatch
  raises ``ValueError`` on every rank instead of hanging in a collective.
* As in Horovod, nothing is communicated when the job has one process (unless
  ``HOROVOD_ELASTIC=1``) or this rank is outside ``process_set``.

Checkpoints: grace state is per rank (each rank's residual is its own). ``state_dict()`` holds
this rank's part; ``gathered_state_dict()`` (a collective: call it on every rank) holds every
rank's, so a checkpoint written by rank 0 alone restores all ranks. ``load_state_dict()`` takes
this rank's entry and raises ``ValueError`` if the checkpoint has none for it or was written by
a job of another size. Use ``grace_dl.torch.horovod.broadcast_optimizer_state``, which runs the
state-initialising step of Horovod's function without communicating.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch

from grace_dl import validate
from grace_dl.communicators import agreement
from grace_dl.communicators.base import AVERAGE, SUM, accumulator
from grace_dl.communicators.buckets import check_bucket_bytes
from grace_dl.communicators.exchange import Exchange, check_saved
from grace_dl.communicators.fusion import split_evenly
from grace_dl.communicators.pieces import (
    AUTO,
    DEFAULT_PIECE_BYTES,
    check_piece_bytes,
    device_piece_bytes,
    effective_piece_bytes,
    piece_name,
    piece_sizes,
)
from grace_dl.contracts import carried_by, check_grace, check_uncarried
from grace_dl.state import unclaimed_keys
from grace_dl.torch.buckets import Bucket, given, plan
from grace_dl.torch.trees import to_numpy, to_torch

GRACE_KEY = "grace"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: what a refusal adds where ``piece_bytes="auto"`` (a checkpoint of another device's run)
AUTO_MEANS = (f" ('auto' is pieces of {DEFAULT_PIECE_BYTES} bytes on the CPU and whole on a "
              f"GPU: {DEFAULT_PIECE_BYTES} for a CPU run's checkpoint, None for a GPU run's)")


def DistributedOptimizer(optimizer, named_parameters=None, compression=None,  # noqa: N802
                         backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None,
                         grace=None, piece_bytes=AUTO, bucket_bytes=None,
                         early_rounds=False):
    """Wrap ``optimizer`` so gradients are averaged across Horovod ranks before ``step()``.

    Takes ``horovod.torch.DistributedOptimizer``'s arguments (same defaults) plus ``grace``: a
    communicator such as ``grace_dl.grace_from_params({...})`` or a strategy dispatcher. With
    ``grace=None`` the result *is* Horovod's optimizer. With ``grace`` set, ``compression`` must
    stay Horovod's ``Compression.none`` (grace does the compressing) and the behaviour is the
    one described in this module's docstring. ``piece_bytes`` (grace only): a gradient larger
    than this is sent in pieces of at most this many bytes where the compressor allows
    (``grace_dl.communicators.pieces``); ``None`` sends every gradient whole; ``"auto"``
    (default): 4 MiB for gradients on the CPU, whole on a GPU.
    ``bucket_bytes`` (grace only): pack gradients into buckets of about this many bytes, each
    compressed and sent as one tensor (``grace_dl.torch.buckets``); ``None``: per parameter.
    ``early_rounds`` (grace only): the gradient hooks complete exchanges whose collectives
    have finished, so later rounds start during the backward pass (``Router.advance``);
    ``False`` (default) leaves every completion to ``synchronize()``. Same results.
    """
    import horovod.torch as hvd

    compression = hvd.Compression.none if compression is None else compression
    op = hvd.Average if op is None else op
    process_set = hvd.global_process_set if process_set is None else \
        validate.process_set(process_set)
    if grace is None:
        check_bucket_bytes(bucket_bytes, None)
        # Horovod's own optimizer first, so that its argument checks (duplicate names, ...)
        # raise its own errors, also before hvd.init(); the agreement check after
        horovod_optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters, compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
            groups=groups, sparse_as_dense=sparse_as_dense, process_set=process_set)
        _check_no_grace_agrees(process_set, hvd)
        return horovod_optimizer

    check_grace(grace)
    check_uncarried(grace, "DistributedOptimizer")
    check_piece_bytes(piece_bytes)
    validate.boolean("early_rounds", early_rounds)
    if compression is not hvd.Compression.none:
        raise ValueError(f"compression={compression!r} cannot be combined with grace=; the "
                         f"grace communicator compresses (accepted: hvd.Compression.none)")
    grace_op = _grace_op(op, hvd)
    grace.check_op(grace_op)
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be a positive integer, got "
                         f"{backward_passes_per_step!r}")
    try:
        factor = float(gradient_predivide_factor)
    except (TypeError, ValueError):
        raise ValueError(f"gradient_predivide_factor must be a positive number, got "
                         f"{gradient_predivide_factor!r}") from None
    if not factor > 0:
        raise ValueError(f"gradient_predivide_factor must be a positive number, got "
                         f"{gradient_predivide_factor!r}")
    if factor != 1.0 and grace_op != AVERAGE:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} is only "
                         f"supported with op=Average, got op={op!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` (as in Horovod).",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    _check_groups(groups)
    check_bucket_bytes(bucket_bytes, grace, groups)
    _attach_process_set(grace, process_set, hvd)
    from grace_dl.recipes import optimizer_momentum, warn_known_problems

    warn_known_problems(grace, optimizer_momentum(optimizer.param_groups))

    cls = type(optimizer.__class__.__name__, (_GraceDistributedOptimizer, optimizer.__class__),
               {})
    wrapped = cls(optimizer.param_groups, named_parameters, grace, backward_passes_per_step,
                  grace_op, factor, groups, sparse_as_dense, process_set, piece_bytes,
                  bucket_bytes, early_rounds)
    carried_by(grace, wrapped)
    return wrapped


def _grace_op(op, hvd) -> str:
    if isinstance(op, str) and op.lower() in (AVERAGE, SUM):
        return op.lower()
    if not isinstance(op, bool) and isinstance(op, int):
        if op == hvd.Average:
            return AVERAGE
        if op == hvd.Sum:
            return SUM
        names = {hvd.Adasum: "Adasum", hvd.Min: "Min", hvd.Max: "Max", hvd.Product: "Product"}
        if op in names:
            raise ValueError(f"op=hvd.{names[op]} cannot carry compressed gradients; with grace= "
                             f"op must be one of hvd.Average, hvd.Sum")
    raise ValueError(f"op must be one of hvd.Average, hvd.Sum (or 'average', 'sum') with "
                     f"grace=, got {op!r}")


def _check_groups(groups) -> None:
    if groups is None:
        return
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"groups must be a list of lists of torch.Tensor, got an "
                                     f"element {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    elif isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(f"groups must be a positive integer or a list of lists of "
                         f"torch.Tensor, got {groups!r}")


def _attach_process_set(grace, process_set, hvd) -> None:
    """The communicator runs its collectives on the optimizer's process set."""
    current = getattr(grace, "process_set", None)
    if process_set is hvd.global_process_set:
        if current is not None and current is not hvd.global_process_set:
            raise ValueError(f"grace communicator uses process_set={current}, but the optimizer "
                             f"was given the global process set: every rank would start "
                             f"collectives of a set it may not belong to; pass "
                             f"process_set={current} to DistributedOptimizer too")
        return
    if current is not None and current is not process_set \
            and current is not hvd.global_process_set:
        raise ValueError(f"grace communicator already uses process_set={current}, but the "
                         f"optimizer was given process_set={process_set}")
    grace.process_set = process_set


def _check_no_grace_agrees(process_set, hvd) -> None:
    """A ``grace=None`` rank takes part in the grace ranks' agreement check, so a job where only
    some ranks pass ``grace=`` fails on every rank instead of hanging."""
    if process_set.included() and (hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
        rank = process_set.rank()
        agreement.check({"grace configuration": None},
                        agreement.allgather_for("torch", process_set),
                        "grace.optimizer.agreement", hvd.rank() if rank is None else rank)


def _check_names(saved: dict, names) -> None:
    """Saved grace state must belong to parameters this optimizer has, or it would be dropped."""
    unclaimed = unclaimed_keys(saved, names)
    if unclaimed:
        raise ValueError(f"checkpoint grace state for {sorted(unclaimed)[:5]} (of "
                         f"{len(unclaimed)} entries) matches no parameter name of this optimizer "
                         f"({sorted(names)[:5]}...); the model was named differently when it was "
                         f"saved (wrapped in another module?): pass named_parameters with the "
                         f"saved names")


class _GraceDistributedOptimizer:
    """Mixed in before the user's optimizer class by ``DistributedOptimizer``."""

    def __init__(self, params, named_parameters, grace, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set,
                 piece_bytes=AUTO, bucket_bytes=None, early_rounds=False):
        super().__init__(params)
        import horovod.torch as hvd

        self._hvd = hvd
        self.grace = grace
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = bool(sparse_as_dense)
        self.process_set = process_set
        self._parameter_names = self._name_parameters(named_parameters)
        fusion = self._fusion_groups(groups)
        if fusion:
            grace.fuse(fusion)
        # None: whole; "auto": by each gradient's device (_pieces)
        self.piece_bytes = effective_piece_bytes(grace, piece_bytes)
        self.bucket_bytes = bucket_bytes  # checked by DistributedOptimizer
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        # buckets: of bucket_bytes, or those a strategy names (its other parameters alone)
        self._buckets = plan(reversed(trainable), self._parameter_names, bucket_bytes) \
            if bucket_bytes is not None else \
            given(trainable, self._parameter_names, getattr(grace, "buckets", None))
        self._bucket_of = {p: (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        #: parameter -> what its hook started this step: its unit, or its bucket
        self._handles: dict = {}
        #: this step's grace tensors (``grace_dl.communicators.exchange``)
        self._exchange = Exchange(grace, op)
        self.early_rounds = early_rounds
        #: phases the hooks completed before ``synchronize()`` (``early_rounds``), all steps
        self.phases_completed_early = 0
        self._hook_handles: list = []
        self._requires_update: set = set()
        self._synchronized = False
        self._should_synchronize = True

        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.dtype not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"parameter {self._parameter_names[p]!r} has dtype {p.dtype}; grace "
                        f"compresses {', '.join(str(d) for d in _FLOAT_DTYPES)} gradients")
        if process_set.included() and (hvd.size() > 1
                                       or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._check_ranks_agree()
            self._register_hooks()

    # ------------------------------------------------------------------ set-up
    def _name_parameters(self, named_parameters) -> dict:
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                                for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found "
                             f"duplicates: {', '.join(dups)}")
        named_ids = {id(v) for _, v in named_parameters}
        unnamed = [id(v) for g in self.param_groups for v in g["params"] if id(v) not in named_ids]
        if unnamed:
            raise ValueError(f"named_parameters was specified, but one or more model parameters "
                             f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
        optimized = {id(v) for g in self.param_groups for v in g["params"]}
        return {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])
                if id(v) in optimized}

    def _fusion_groups(self, groups) -> list[list[str]]:
        """``groups`` as lists of parameter names (see the module doc)."""
        if groups is None:
            return []
        if isinstance(groups, int):
            return split_evenly(sorted(name for p, name in self._parameter_names.items()
                                       if p.requires_grad), groups)
        # as Horovod forms them: of the optimizer's parameters that take gradients (a list
        # naming every model parameter, for an optimizer of some of them, fine-tunes those)
        fusion = [[self._parameter_names[p] for p in group
                   if p in self._parameter_names and p.requires_grad] for group in groups]
        return [group for group in fusion if group]

    def _check_ranks_agree(self) -> None:
        """Every rank must run the same pipelines on the same tensors, or collectives hang."""
        layout = sorted([name, list(p.shape), str(p.dtype), bool(p.requires_grad)]
                        for p, name in self._parameter_names.items())
        labels = {"grace configuration": agreement.grace_label(self.grace), "parameters": layout,
                  "optimizer options": {
                      "op": self.op, "gradient_predivide_factor": self.gradient_predivide_factor,
                      "backward_passes_per_step": self.backward_passes_per_step,
                      "sparse_as_dense": self.sparse_as_dense, "piece_bytes": self.piece_bytes,
                      "buckets": self._bucket_layout(), "pieces": self._piece_layout()}}
        agreement.check(labels, agreement.allgather_for("torch", self.process_set),
                        "grace.optimizer.agreement", self._rank())

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._hook_handles.append(
                        p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(*_):
            if p in self._handles and self._handles[p] is not None \
                    and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            assert not p.grad.requires_grad
            assert self._allreduce_delay[p] > 0
            self._allreduce_delay[p] -= 1
            self._handles[p] = self._start(p) if self._allreduce_delay[p] == 0 else None
            if self.early_rounds:
                self._advance(self._handles[p])
        return hook

    def _advance(self, started) -> None:
        """Queue what a hook just sent (a unit, or a bucket: its unit once it filled up) and
        complete the queued exchanges whose collectives have finished."""
        unit = started.unit if isinstance(started, Bucket) else started
        self.phases_completed_early += self._exchange.advance(unit)

    # ------------------------------------------------------------------ one tensor's pipeline
    def _start(self, p):
        """``p``'s gradient is ready: send it, or put it in its bucket (sent once full)."""
        return self._fill(p) if self._buckets else self._send(p)

    def _gradient(self, p):
        """``p``'s gradient as grace takes it: dense, detached, predivided."""
        if p.grad is None:
            # No gradient on this rank this step; another rank may have one, so send zeros.
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                raise ValueError(f"parameter {self._parameter_names[p]!r} has a sparse "
                                 f"gradient; grace compresses dense tensors: pass "
                                 f"sparse_as_dense=True")
            tensor = tensor.to_dense()
        tensor = tensor.detach()
        if self.gradient_predivide_factor != 1.0:
            tensor = tensor * (1.0 / self.gradient_predivide_factor)
        return tensor

    def _fill(self, p):
        """Copy ``p``'s gradient into its bucket (or add it into the memory's slot where
        ``accumulator`` gives one); send the bucket when it is full. A parameter alone in its bucket
        is sent as its own gradient under the bucket's name (no copy)."""
        bucket, i = self._bucket_of[p]
        if len(bucket.params) == 1:
            bucket.unit = self._send(p, bucket.name)
            return bucket
        flat = bucket.buffer()
        if bucket.ready == 0:
            bucket.sums = self._sums(bucket, flat, self._bucket_pieces(flat))
        if bucket.sums is None:
            bucket.view(i).copy_(self._gradient(p))
        else:
            bucket.add(i, self._gradient(p))
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.unit = self._exchange.start(flat, bucket.name, bucket.params, bucket.numels,
                                              flat, self._bucket_pieces(flat))
        return bucket

    def _bucket_pieces(self, flat):
        """The pieces a bucket's buffer is sent in (None: whole)."""
        return self._pieces(flat.numel(), flat)

    def _sums(self, bucket, flat, sizes):
        """``[(start, slot)]``: the memory's slots where this step's gradients of ``bucket``
        are added (``accumulator``), one per piece of ``sizes`` or one for the whole bucket;
        None to copy them into the buffer instead."""
        pieces = [flat] if sizes is None else flat.split(sizes)
        names = [bucket.name] if sizes is None else \
            [piece_name(bucket.name, j) for j in range(len(sizes))]
        sums, start = [], 0
        for name, piece in zip(names, pieces):
            slot = accumulator(self.grace, name, piece)
            if slot is None:    # the same for every piece: one communicator and memory
                return None
            sums.append((start, slot))
            start += piece.numel()
        return sums

    def _send(self, p, name=None):
        """Start ``p``'s gradient as the grace tensor ``name`` (default: ``p``'s name)."""
        name = self._parameter_names[p] if name is None else name
        tensor = self._gradient(p)
        into = self._into(p)
        sizes = self._piece_sizes(p, name)
        if sizes is not None and into is not None and into.is_contiguous():
            # the pieces are slices of p.grad, results written there
            return self._exchange.start(into.view(-1), name, [p], None, into, sizes)
        return self._exchange.start(tensor, name, [p], None, into)

    def _piece_sizes(self, p, name: str):
        """The pieces ``p``'s gradient is sent in (None: whole), from its size: not for a
        fusion group's member or a predivided gradient (``_send`` also needs ``p.grad`` to
        be dense and contiguous)."""
        if self._fused(name) or self.gradient_predivide_factor != 1.0:
            return None
        return self._pieces(p.numel(), p)

    def _pieces(self, numel: int, like):
        """The pieces of ``numel`` elements of ``like``'s dtype and device (None: whole)."""
        return piece_sizes(numel, like.element_size(), device_piece_bytes(self.piece_bytes, like))

    def _piece_layout(self) -> dict:
        """``{name: number of pieces}`` of the parameters (or buckets) sent in pieces (what
        keys their state)."""
        layout = {}
        for b in self._buckets:
            sizes = self._piece_sizes(b.params[0], b.name) if len(b.params) == 1 else \
                self._pieces(sum(b.numels), b.params[0])
            if sizes is not None:
                layout[b.name] = len(sizes)
        for p, name in [] if self._buckets else self._parameter_names.items():
            sizes = self._piece_sizes(p, name) if p.requires_grad else None
            if sizes is not None:
                layout[name] = len(sizes)
        return layout

    def _bucket_layout(self) -> dict:
        """``{bucket name: its parameters' names}`` (empty without buckets)."""
        return {b.name: b.names for b in self._buckets}

    def _state_names(self) -> list[str]:
        """The names grace state is keyed by: the buckets', else the parameters'."""
        return [b.name for b in self._buckets] or list(self._parameter_names.values())

    def _fused(self, name: str) -> bool:
        """Whether ``name`` travels in a fusion group (then whole: the group holds it)."""
        fusion = getattr(self.grace, "fusion", None)
        return fusion is not None and fusion.holds(name)

    def _into(self, p):
        """Where the result goes: ``p.grad`` itself unless it must be rescaled or densified."""
        return p.grad if self.gradient_predivide_factor == 1.0 and not p.grad.is_sparse else None

    def _write(self, p, unit) -> None:
        """Put ``p``'s received ``unit``'s result in ``p.grad`` (already there where the unit
        was sent into it)."""
        if unit.lands:
            self._allreduce_delay[p] = self.backward_passes_per_step
        else:
            self._write_result(p, unit.out)

    def _write_result(self, p, out) -> None:
        """Copy ``out`` into ``p.grad``, rescaled by the predivide factor, densified back."""
        if self.gradient_predivide_factor != 1.0:
            out = out * self.gradient_predivide_factor
        if p.grad.is_sparse:
            p.grad.zero_().add_(out.to_sparse())
        else:
            p.grad.copy_(out)
        self._allreduce_delay[p] = self.backward_passes_per_step

    # ------------------------------------------------------------------ Horovod's interface
    def set_backward_passes_per_step(self, passes: int) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got "
                             f"{passes!r}")
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def synchronize(self) -> None:
        """Finish every parameter's compressed exchange and write the result into ``p.grad``."""
        if not self._requires_update:
            self._synchronized = True
            return
        # Name order: identical on every rank, whatever order the hooks fired in (multi-round
        # communicators start collectives inside receive).
        for p in sorted(self._requires_update, key=self._parameter_names.__getitem__):
            if self._handles.get(p) is None:
                self._handles[p] = self._start(p)
        if self._buckets:
            self._receive_buckets()
        else:
            self._receive_parameters()
        self._handles.clear()
        self.grace.end_step()
        self._synchronized = True

    def _receive_buckets(self) -> None:
        """Receive every bucket (layout order: the same on every rank). A lone parameter's
        result lands in its ``p.grad`` as per parameter; a bucket's lands in its buffer, whose
        slices become the members' gradients (``_adopt``)."""
        buckets = self._buckets
        self._exchange.finish([b.unit for b in buckets])
        for b in buckets:
            if len(b.params) == 1:
                self._write(b.params[0], b.unit)
            else:
                for i, p in enumerate(b.params):
                    self._adopt(p, b.view(i))
            b.ready, b.unit = 0, None

    def _adopt(self, p, view) -> None:
        """The bucket's slice ``view`` becomes ``p.grad`` where nothing tells them apart (a
        dense gradient of a contiguous parameter, not rescaled), saving a copy; else it is
        copied in."""
        if self.gradient_predivide_factor == 1.0 and not p.grad.is_sparse and \
                p.is_contiguous():
            p.grad = view
            self._allreduce_delay[p] = self.backward_passes_per_step
        else:
            self._write_result(p, view)

    def _receive_parameters(self) -> None:
        params = sorted(self._handles, key=self._parameter_names.__getitem__)
        units = self._exchange.finish([self._handles[p] for p in params])
        for p, unit in zip(params, units):
            self._write(p, unit)

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (use after ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): gradients are exchanged "
                              "(and compressed) a second time.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(). This is "
                                 "prohibited as it can cause a race condition.")
        return super().zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ checkpoints
    def _grace_entry(self) -> dict:
        return {"size": self._size(), "fingerprint": self.grace.fingerprint(),
                "pieces": self._piece_layout(), "buckets": self._bucket_layout(),
                "ranks": {self._rank(): to_torch(self.grace.state_dict())}}

    def _size(self) -> int:
        size = self.process_set.size()
        return self._hvd.size() if size is None else size

    def _rank(self) -> int:
        rank = self.process_set.rank() if self.process_set.included() else None
        return self._hvd.rank() if rank is None else rank

    def state_dict(self):
        """The wrapped optimizer's state plus ``"grace"``: this rank's grace state."""
        state = super().state_dict()
        state[GRACE_KEY] = self._grace_entry()
        return state

    def gathered_state_dict(self):
        """Like ``state_dict`` with every rank's grace state (a collective: all ranks call it),
        so that a checkpoint written by one rank restores every rank."""
        state = super().state_dict()
        entry = self._grace_entry()
        if self._requires_update:
            from horovod.torch.functions import allgather_object

            if self.process_set is not self._hvd.global_process_set:
                raise ValueError("gathered_state_dict() needs the global process set; save "
                                 "state_dict() on every rank instead")
            for other in allgather_object(entry["ranks"], name="grace.optimizer.state"):
                entry["ranks"].update(other)
        state[GRACE_KEY] = entry
        return state

    def load_state_dict(self, state_dict) -> None:
        """Restore the wrapped optimizer and, if the checkpoint has it, this rank's grace state."""
        state_dict = dict(state_dict)
        entry = state_dict.pop(GRACE_KEY, None)
        if entry is None:
            warnings.warn(f"the checkpoint has no {GRACE_KEY!r} entry (saved from a plain "
                          f"optimizer?): grace state (residuals, momenta, step counters) starts "
                          f"fresh", RuntimeWarning, stacklevel=2)
        else:
            rank, size = self._rank(), self._size()
            check_saved(entry, {"size": size, "fingerprint": self.grace.fingerprint()},
                        self.grace)
            ranks = entry.get("ranks", {})
            if rank not in ranks:
                raise ValueError(f"checkpoint grace state holds ranks {sorted(ranks)}, not this "
                                 f"rank {rank}: save state_dict() on every rank, or "
                                 f"gathered_state_dict() on all ranks and write it from one")
            # buckets and pieces key the state (older checkpoints have neither)
            saved, mine = entry.get("buckets", {}), self._bucket_layout()
            if saved != mine:
                raise ValueError(f"checkpoint grace state was written with other buckets "
                                 f"(bucket_bytes): saved {len(saved)} bucket(s) "
                                 f"{sorted(saved)[:3]}, this optimizer has {len(mine)} "
                                 f"{sorted(mine)[:3]} (bucket_bytes={self.bucket_bytes!r}); "
                                 f"pass the bucket_bytes the checkpoint was written with to "
                                 f"DistributedOptimizer")
            saved, mine = entry.get("pieces", {}), self._piece_layout()
            if saved != mine:
                differ = sorted(n for n in {*saved, *mine} if saved.get(n) != mine.get(n))
                raise ValueError(f"checkpoint grace state was written with other pieces "
                                 f"(piece_bytes) for {differ[:5]}: saved "
                                 f"{[saved.get(n, 1) for n in differ[:5]]} pieces, this "
                                 f"optimizer sends {[mine.get(n, 1) for n in differ[:5]]} "
                                 f"(piece_bytes={self.piece_bytes!r}); pass the piece_bytes "
                                 f"the checkpoint was written with to DistributedOptimizer"
                                 + (AUTO_MEANS if self.piece_bytes == AUTO else ""))
            _check_names(ranks[rank], self._state_names())
            self.grace.load_state_dict(to_numpy(ranks[rank]))
        self._handles = {}
        for b in self._buckets:
            b.ready, b.unit = 0, None
        self._exchange.clear()
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        super().load_state_dict(state_dict)
