"""A PyTorch DDP communication hook that carries gradients through a grace_dl communicator:
every compressor, memory and communicator of ``grace_from_params``, on ``torch.distributed``,
no Horovod.

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from grace_dl import grace_from_params
    from grace_dl.torch import ddp as grace_ddp

    dist.init_process_group("gloo")            # torchrun sets the rendezvous variables
    model = DDP(net)
    state = grace_ddp.GraceState(grace_from_params({"compressor": "topk", "memory": "residual",
                                                    "communicator": "allgather",
                                                    "compress_ratio": 0.01}),
                                 process_group=None)          # None: the default group
    model.register_comm_hook(state, grace_ddp.comm_hook)
    ...                                        # checkpoint: state.state_dict() per rank

Shaped like PyTorch's own ``PowerSGDState`` + ``powerSGD_hook``: one state object holding the
options and the training state, one hook function.

**What the hook sends.** DDP calls the hook once per gradient bucket, in bucket order (the
same on every rank), with the bucket's flat buffer of summed-over-micro-batches gradients. The
hook hands it to the communicator's ``send`` with ``DistCollectives`` on the state's process
group (``grace_dl.torch.distributed``: what goes on the wire there), which compensates with the
memory, compresses and *starts* the collectives (``grace_dl.communicators.exchange``). On gloo
it returns an unfinished future, and when DDP hands over the last bucket
(``bucket.is_last()``) the hook ``receive``\\ s every bucket of the step in bucket order
(multi-round PowerSGD and two-phase start their later collectives there, in the same order on
every rank), so the host never waits for one bucket's collectives while the backward pass could
go on. On NCCL, where waiting for a collective holds the GPU's stream and not the host, each
bucket is received in its own hook call and its future completed at once, as PyTorch's own
hooks do: its decompression queues behind its collectives while the backward pass still runs,
instead of every bucket's waiting for the last. That work runs on a side stream of the
bucket's device, made to wait for the backward pass's stream at each bucket (the future's
events are recorded on it, which DDP waits for at the end of the backward pass): waiting for a
collective makes the waiting stream wait, and on the backward pass's own stream the rest of
the backward pass would queue behind every bucket's collectives. But from the first bucket
whose payload's size depends on the data (signs with a zero plane, threshold) on, the buckets
are received at the last one, with the step's one read of such sizes (``Collectives.sized``:
reading one makes the host wait for the GPU). Same bits either way. The last bucket closes
the step in ``grc.bytes`` (``grc.end_step()``). Results land in DDP's own bucket:
each grace tensor that is the bucket's buffer or a gradient's view of it is sent and received
with ``into=`` that memory, and the future returns the buffer. The grace tensors of one bucket
(``"parameter"`` granularity) share one ``GroupCollectives`` and are received together
(``Router.receive_all``, phases in lockstep), so each round goes out as one collective per
kind and dtype per bucket: PowerSGD sends one allreduce of the bucket's Ps (and uncompressed
tensors) and one of its Qs, as PyTorch's ``powerSGD_hook`` does. Grace's own PowerSGD pipeline
(``Allreduce``, memory ``powersgd``) takes a bucket path with the same bits, bytes and state and
none of the per-tensor plumbing (``grace_dl.torch.ddp_powersgd``). Communication of early
buckets thus overlaps the rest of the backward pass; the wire traffic is the communicator's (see its
module docstring), and ``grc.bytes.steps[-1]`` says how many bytes this rank moved. Grace
``none`` (``Allreduce``, memory ``none``: ``sums_in_place``) is summed by the hook itself, in
place, as PyTorch's allreduce hook does, and grace ``fp16`` (memory ``none``: ``sums_in_half``)
is cast, summed in place and cast back with the average's division into the bucket, the work of
PyTorch's fp16 hook: the send path's collective, bits and byte counts without its Python.

**Granularity.** ``"bucket"``: one grace tensor per bucket (a flat 1-D buffer), so a
compressor sees whole buckets and the number of collectives is the number of buckets
(sparsifiers, quantizers, signs, fp16: their payload does not depend on layer shapes; topk's k
is then a fraction of the bucket, not of each layer). ``"parameter"``: one grace tensor per
parameter, in the bucket's order, shaped like the parameter (DDP's views into the bucket); the
result is concatenated back into the bucket's layout. ``"auto"`` (default): ``"parameter"``
for compressors that need layer shapes (PowerSGD's matrices: compressors with a
``matrix_shape`` method), for strategy dispatchers (they route per parameter name) and for a
``Schedule`` with a stage of either; ``"bucket"`` otherwise (a ``Schedule`` of such stages
too: its layout is one for every stage).

**Pieces.** In ``"bucket"`` granularity, for compressors that compress any 1-D chunk on its
own and do compress (quantizers, signs, fp16; not ``none``), a bucket larger than
``piece_bytes`` is sent as even pieces of at most that size, each its own grace tensor
``<bucket name>/piece<i>`` (``grace_dl.communicators.pieces``), so that one piece's
compression overlaps the previous piece's exchange. The default, ``"auto"``, cuts buckets on
the CPU into 4 MiB pieces and sends a GPU's buckets whole (a GPU compresses a bucket faster
than a piece's round of Python and collectives); the first bucket's device decides.
Sparsifiers keep their bucket whole. ``piece_bytes`` is part of the checkpoint (as the first
bucket resolved it): a state saved with other pieces is refused by ``load_state_dict``, since
its residuals are keyed by the pieces' names; a state whose ``"auto"`` has not met a bucket
yet takes the checkpoint's. A checkpoint written before pieces existed (no ``piece_bytes``)
loads; a bucket now sent in pieces then starts fresh residuals, which error feedback
tolerates as it does at DDP's bucket rebuild.

**Names.** Grace state (residuals, PowerSGD's Q, step counters) is keyed by tensor name. A
parameter's name is its name in ``named_parameters`` if given, else ``param<i>``, ``i`` being
the order in which the hook first met it (deterministic: DDP computes the same first bucket
layout on every rank and in every run of the same script). In ``"bucket"`` granularity a
bucket is sent as DDP lays it out (its buffer is the grace tensor: no copy in or out, whatever
order DDP gives its gradients, as a transformer's graph order) and the grace tensor is named
``bucket<n>:<digest>`` of its members' names in that order, so state (a residual's element
layout) follows the bucket's content and order, not its index. DDP's rebuilt buckets are the
same on every rank (DDP takes rank 0's) and in every step after the first. So one grace
object serves one ``GraceState``: a second one made on it while the first lives (two DDP
models: their names meet) raises ``ValueError``; build a grace object for each.

**DDP's behaviours.**

* *First-iteration bucket rebuild*: DDP re-buckets after the first iteration, in the order
  gradients became ready. Bucket names follow content and order, so a rebuilt bucket that
  differs from its first-iteration one simply starts its own state (a fresh residual, which
  error feedback tolerates), and the state of the first iteration's buckets that are gone is
  dropped at the end of that step (memory and checkpoints keep only what later steps read);
  per-parameter state does not notice the rebuild at all.
* ``no_sync()``: DDP does not call the hook inside it; gradients accumulate locally and the
  next synchronised backward hands the accumulated buckets over. Nothing is compressed or
  counted for the skipped passes.
* ``find_unused_parameters=True``: DDP fills unused parameters' slots of the bucket with zeros
  before calling the hook; the hook compresses and sends them like any gradient (every rank
  must take part in every collective).
* ``gradient_as_bucket_view=True``: the gradients are DDP's buckets themselves, which the
  hook writes its results into anyway: the same bits as without it.
* ``static_graph=True``: DDP rebuilds its buckets after the second iteration instead of the
  first; the hook follows (the first layout's state is dropped then). Pipelines whose state
  is per bucket (error feedback in ``"bucket"`` granularity) thus restart it one step later
  than without the option (other bits than DDP's default from there on, the same names,
  bytes and state keys); the others give the same bits. Its first iteration DDP ends by a
  *delayed allreduce*: every bucket (one a dtype there) handed over at the end of the
  backward pass as bucket 0, none as the last, all awaited before the pass ends; the hook
  then finishes each bucket in its own call and ends its step at the end of the pass.
* A model in bfloat16 or float16: the buckets are in its dtype and each compressor sends
  what it sends for that dtype. A complex parameter's gradient is sent as its real view
  (``torch.view_as_real``, shape ``(*shape, 2)``): DDP's bucket holds it so.
* ``join()`` (uneven inputs): for each step the other ranks still take, DDP runs the hook of a
  rank that ran out of batches on zero buckets; the hook sends them as any gradient (its
  error feedback goes on as for a zero gradient), so the collectives stay matched.

**Averaging.** ``op="average"`` (default) gives DDP's result: the sum over ranks divided by the
group size (compressors that already normalise, like signSGD's majority vote, are not
divided). ``op="sum"`` leaves the sum. For ``none``/``allreduce`` it equals DDP's own allreduce
bit for bit at a power-of-two group size; DDP divides each rank's gradient before the sum and
grace divides the sum (as Horovod does), so at other sizes, or for float16 gradients small
enough to lose bits when halved, the two differ in the last bit. Dividing after the sum keeps
the small gradients' bits and lets a float16 sum overflow where DDP's would not (by a factor of
the group size: ``GradScaler`` then settles on a smaller scale).

**Checkpoints.** ``state.state_dict()`` is this rank's grace state (CPU tensors, so
``torch.load`` reads it with its default ``weights_only=True``), the grouping of the last step,
the parameter naming, the fingerprint of the configuration and the rank and group size that
wrote it; save it on every rank and pass it to ``load_state_dict`` of a fresh ``GraceState``
before the first step, or of the live one to roll back to it: the run continues bit for bit.
Another configuration's state, another rank's (residuals are per rank) or another group
size's is refused with ``ValueError``, as the Horovod optimizer and TF checkpoints refuse it
(``grace_dl.communicators.exchange.check_saved``). A resumed DDP starts again from its
first-iteration layout, so in ``"bucket"`` granularity the hook's first iteration after
``load_state_dict`` groups gradients as the saved run last did: buckets that match a saved
group are sent at once, the others are held until DDP hands over the last bucket, then cut into
the saved groups (that one iteration overlaps less); from the second iteration on it follows
DDP's (rebuilt) buckets again. Under ``static_graph=True`` DDP keeps its first layout two
iterations (the first its delayed allreduce), and the hook regroups both. A checkpoint written
after the first iteration under ``static_graph`` holds the first layout's state, which the
original run drops at DDP's rebuild, its third step, and the resumed one a step later: that
resume is not bit for bit (one written at any later step is).

**Agreement.** The first hook call of a ``GraceState`` all-gathers a digest of the grace
configuration, the granularity, the op and the bucket's layout; ranks that differ raise
``ValueError`` on every rank instead of hanging in a collective. Before that gather, each rank
marks in the process group's store that it reached the grace hook and waits (at most
``agreement_timeout`` seconds, default 30) for every rank's mark: a rank that runs plain DDP
(the hook registered on some ranks only) never marks, and the grace ranks raise ``ValueError``
naming it instead of waiting in a collective the plain rank never starts. (The plain rank runs
no grace code: it fails when the grace ranks exit, or is stopped by ``torchrun``.)

**Sparse gradients** (``nn.Embedding(sparse=True)``) are refused with ``ValueError`` naming the
parameter, as the Horovod optimizer refuses them without ``sparse_as_dense``: compressors work
on dense tensors, and DDP expects a sparse bucket back. Build such modules with dense gradients.

**Non-finite gradients** are sent in the step they occur in and kept in no state
(``grace_dl.memory.base``), so AMP's ``GradScaler`` skips that step and the next is finite;
``state.reset()`` zeroes the accumulated state (error feedback, momenta) of every grace tensor.

**Pickling.** A ``GraceState`` pickles and deep-copies (``torch.save(state)``,
``copy.deepcopy``) as PyTorch's ``PowerSGDState`` does: the process group is dropped and the
copy binds the default group when first used (set ``state.process_group`` to bind another; a
copy made on a group of other ranks than the world refuses to run until it is set). Parameters
are named by identity while training, which a reloaded model does not keep: a copy names the
parameters it meets by their position in DDP's first bucket layout, as the original first met
them (checked against their shapes), so it resumes the original's training on a rebuilt model
and a fresh DDP bit for bit.

DDP checks the hook's annotations, so this module does not use postponed evaluation
(``from __future__ import annotations``).
"""


import contextlib
import datetime
import math
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from grace_dl.communicators import agreement
from grace_dl.communicators.allreduce import Allreduce
from grace_dl.communicators.base import AVERAGE, check_op
from grace_dl.communicators.buckets import bucket_name, needs_shapes
from grace_dl.communicators.exchange import Exchange, check_saved
from grace_dl.communicators.fusion import GroupCollectives
from grace_dl.communicators.pieces import (
    AUTO,
    check_piece_bytes,
    device_piece_bytes,
    effective_piece_bytes,
    piece_sizes,
)
from grace_dl.communicators.wire import ring_allreduce_bytes
from grace_dl.compressors.fp16 import FP16Compressor
from grace_dl.compressors.none import NoneCompressor
from grace_dl.contracts import carried_by, check_grace, check_uncarried
from grace_dl.recipes import communicators
from grace_dl.state import unclaimed_keys, without_slots
from grace_dl.torch.ddp_powersgd import PowerSGDBuckets
from grace_dl.torch.distributed import DistCollectives
from grace_dl.torch.ops import assign_div
from grace_dl.torch.trees import to_numpy, to_torch

GRANULARITIES = ("auto", "bucket", "parameter")
#: a unit's parameter names and its grace tensor's name (``grace_dl.communicators.exchange``)
_MEMBERS = operator.attrgetter("members")
_NAME = operator.attrgetter("name")
#: how long the first hook call waits for every rank to reach its own (``agreement_timeout``)
DEFAULT_AGREEMENT_TIMEOUT = 30.0
#: per process group (its global ranks): how many GraceStates have checked agreement on it,
#: the same count on every rank of the group (each runs the same script), which keys the
#: store entries of the next check
_CHECKS: dict = {}


def sums_in_place(grace) -> bool:
    """Whether the hook may sum a bucket itself, in place, as PyTorch's allreduce hook does:
    ``grace`` is exactly grace's ``Allreduce`` of compressor ``none`` with memory ``none``
    (and, checked per bucket, no fusion groups), whose send path does just that (compress:
    the tensor itself; issue: an allreduce of it in place, averaged by its postscale) around
    many Python calls. The same collective, bits and byte counts; chosen when the state is
    built."""
    return (type(grace) is Allreduce and type(grace.compressor) is NoneCompressor
            and grace.feedback.keeps_nothing)


def sums_in_half(grace) -> bool:
    """Whether the hook may send a bucket in float16 itself, as PyTorch's fp16 hook does:
    ``grace`` is exactly grace's ``Allreduce`` of compressor ``fp16`` with memory ``none``,
    whose send path does just that (compress: the cast; issue: an allreduce of it in place;
    complete: the cast back, divided into the bucket) around many Python calls. The same
    operations, bits and byte counts; chosen when the state is built (and, per bucket, for a
    whole bucket that is not already float16)."""
    return (type(grace) is Allreduce and type(grace.compressor) is FP16Compressor
            and grace.feedback.keeps_nothing)


def _routes_by_name(grace) -> bool:
    """Whether ``grace`` is (or holds, as a ``Schedule``'s stage) a strategy dispatcher, which
    finds each gradient's pipeline by its name."""
    from grace_dl.communicators.base import FanOut
    from grace_dl.strategy.dispatcher import StrategyDispatcher

    return isinstance(grace, StrategyDispatcher) or (
        isinstance(grace, FanOut) and any(map(_routes_by_name, grace.parts())))


@dataclass(frozen=True)
class _BucketLayout:
    """What ``GraceState._send`` works out of one DDP bucket's parameters."""

    names: list             # the parameters' names, in the bucket's order
    name: str               # the grace tensor's name when the bucket goes as one
    numels: list            # the gradients' numels in DDP's buffer, in the bucket's order
    pieces: list | None     # the lengths of the pieces its buffer goes in (None: whole)
    #: a bucket of complex parameters: their gradients' shapes as real views (else None)
    real_shapes: list | None = None


class _RealViews:
    """A DDP bucket of complex parameters with ``gradients()`` that are their stretches of
    its buffer: DDP keeps a complex gradient in the buffer as its real view
    (``torch.view_as_real``: 2 numbers an element), but hands the hook views of the
    parameters' shapes over the buffer's real dtype, which cover the first half of each
    stretch only. Anything else is the bucket's own."""

    def __init__(self, bucket, shapes):
        self._bucket = bucket
        numels = [math.prod(shape) for shape in shapes]
        self._grads = [g.view(shape) for g, shape in zip(bucket.buffer().split(numels), shapes)]

    def gradients(self) -> list:
        return list(self._grads)

    def __getattr__(self, name):
        return getattr(self._bucket, name)


class GraceState:
    """Options and state of ``comm_hook``; pass it to ``DDP.register_comm_hook``.

    ``grace``: a communicator from ``grace_from_params`` (or a strategy dispatcher).
    ``process_group``: the group DDP reduces over (``None``: the default group), and the one
    the grace collectives run on. ``granularity``: ``"auto"``, ``"bucket"`` or ``"parameter"``
    (module docstring). ``piece_bytes``: in ``"bucket"`` granularity, a bucket larger than
    this is sent as pieces of at most this many bytes (module docstring, *Pieces*); ``None``
    sends every bucket whole; ``"auto"`` (default): 4 MiB on the CPU, whole on a GPU.
    ``named_parameters``: ``model.named_parameters()`` of the *wrapped* module, to key state by
    real names (needed by strategy dispatchers, which route by name); without it parameters
    are named ``param<i>``. ``op``: ``"average"`` (DDP's) or ``"sum"``.
    ``agreement_timeout``: seconds the first hook call waits for every rank of the group to
    reach the grace hook before it raises (module docstring, *Agreement*).
    """

    def __init__(self, grace, process_group=None, granularity: str = "auto",
                 named_parameters=None, op: str = AVERAGE,
                 piece_bytes: int | str | None = AUTO,
                 agreement_timeout: float = DEFAULT_AGREEMENT_TIMEOUT):
        check_grace(grace)
        check_uncarried(grace, "GraceState")
        self.piece_bytes = check_piece_bytes(piece_bytes)
        if isinstance(agreement_timeout, bool) or \
                not isinstance(agreement_timeout, (int, float)) or not agreement_timeout > 0:
            raise ValueError(f"agreement_timeout must be a positive number of seconds, got "
                             f"{agreement_timeout!r}")
        self.agreement_timeout = float(agreement_timeout)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got "
                             f"{granularity!r}")
        self.op = check_op(op)
        grace.check_op(self.op)
        self.grace = grace
        self._group_ranks = None        # the group's global ranks, known once pickled
        self.process_group = process_group      # also sets self.collectives
        self.granularity = granularity
        self.per_parameter = granularity == "parameter" or (
            granularity == "auto" and needs_shapes(grace))
        # a fused allgather of a bucket's units needs no lengths when sizes are equal
        # (of every communicator behind a Schedule or a strategy: every stage and pipeline)
        comms = communicators(grace)
        self._equal_sizes = bool(comms) and all(c.compressor.caps.equal_sizes for c in comms)
        #: the bucket summed in place as PyTorch's allreduce hook does (``sums_in_place``)
        self._sums_in_place = sums_in_place(grace)
        #: the bucket cast, summed and cast back as PyTorch's fp16 hook does (``sums_in_half``)
        self._sums_in_half = sums_in_half(grace)
        #: PowerSGD's buckets sent by its bucket path (``grace_dl.torch.ddp_powersgd``), and
        #: this step's buckets on it not yet finished
        self._powersgd = PowerSGDBuckets(grace, self.op) \
            if self.per_parameter and PowerSGDBuckets.serves(grace) else None
        self._powersgd_buckets: list = []
        # None where buckets go whole (per-parameter units go whole too: they are fused);
        # "auto" until the first bucket's device resolves it (_piece_sizes)
        self._piece_bytes = None if self.per_parameter else \
            effective_piece_bytes(grace, piece_bytes)
        self.iteration = 0          # synchronised backward passes completed
        self._given_names: dict[int, str] | None = None
        routes_by_name = _routes_by_name(grace)
        if routes_by_name and granularity == "bucket":
            raise ValueError("granularity='bucket' sends DDP's buckets as grace tensors named "
                             "bucket<n>:<digest>, which a strategy (it routes each gradient by "
                             "its parameter's name) has no node for: pass granularity="
                             "'parameter' or 'auto' (the default)")
        if getattr(grace, "buckets", None):
            raise ValueError(f"the strategy packs variables into buckets "
                             f"({len(grace.buckets)}: AllReduceSynchronizer.bucket, as Auto "
                             f"writes them), which the DDP hook cannot carry: DDP lays out its "
                             f"own buckets, and each parameter goes by its strategy node; build "
                             f"it without (Auto(..., bucket_bytes=None))")
        if named_parameters is None and routes_by_name:
            raise ValueError("a strategy routes gradients by their parameters' names: pass "
                             "GraceState(..., named_parameters=model.named_parameters()) of "
                             "the module DDP wraps (without it they are named param<i>)")
        if named_parameters is not None:
            pairs = list(named_parameters)
            if any(not isinstance(x, tuple) or len(x) != 2 for x in pairs):
                raise ValueError("named_parameters must be a sequence of (name, parameter) "
                                 "tuples, as model.named_parameters() gives")
            self._given_names = {id(p): n for n, p in pairs}
        self._names: dict[int, str] = {}        # id(parameter) -> name, as met
        self._order: list[str] = []             # names in the order they were first met
        self._index: dict[str, int] = {}        # name -> position in _order
        self._shapes: dict[str, list] = {}      # name -> its parameter's shape
        # a pickled copy's names in the order the original met them (its parameters are
        # other objects): the i-th parameter met is named _resume[i] (see __setstate__)
        self._resume: list[str] | None = None
        self._named_unmet = False   # pickled with named_parameters before meeting any
        #: this step's grace tensors (units: ``grace_dl.communicators.exchange``)
        self._exchange = Exchange(grace, self.op)
        carried_by(grace, self)
        #: complete each bucket in its own hook call where waiting for a collective holds the
        #: device's stream, not the host (NCCL; module docstring, *What the hook sends*);
        #: None until the first bucket asks the collectives. ``_finished``: this step's units
        #: completed so
        self._per_bucket = None
        self._finished: list = []
        self._streams: dict = {}                # device -> its buckets' side stream
        self._buckets: list = []                # this step's (future, buffer)
        #: in a step of DDP's delayed allreduce (``_delays``), its buckets' parameter ids
        self._delayed: set | None = None
        self._views: dict = {}                  # name -> its gradient's view of its bucket
        self._deferred: dict = {}               # name -> gradient held for _start_deferred
        self._target = None                     # a loaded checkpoint's grouping (bucket mode)
        #: DDP's bucket layout (names per bucket) in the first step regrouped to ``_target``:
        #: the regrouping goes on while DDP hands that layout over (``_end_regrouping``);
        #: ``_regrouped``: this step sent gradients regrouped
        self._resumed_on: list | None = None
        self._regrouped = False
        #: the autograd graph task this step's first bucket was handed over in (``_delays``)
        self._task = None
        self._layout: list = []                 # the grouping of the last completed step
        self._checked = False
        # a bucket's position in the step (its index, but in DDP's delayed allreduce) -> (its
        # parameters' ids, _BucketLayout): what _send works out of its parameters once
        self._bucket_layouts: dict = {}
        self.last_step_names: list[str] = []    # the grace tensors of the last step, in order

    # ------------------------------------------------------------------ process group
    @property
    def process_group(self):
        """The group the grace collectives run on (``None``: the default group); settable,
        e.g. to bind a pickled copy to a new group."""
        return self._process_group

    @process_group.setter
    def process_group(self, group) -> None:
        self._process_group = group
        self.collectives = DistCollectives(group)
        self._group_ranks = None
        self._per_bucket = None     # another group, maybe another backend

    def _bind(self) -> None:
        """A pickled copy's group: the default one, unless the original ran on other ranks."""
        if self.collectives is not None:
            return
        ranks, world = self._group_ranks, list(range(dist.get_world_size()))
        if ranks is not None and ranks != world:
            raise ValueError(f"this GraceState was pickled while it ran on a process group of "
                             f"ranks {ranks}, and process groups do not pickle: set "
                             f"state.process_group to that group (the one DDP reduces over) "
                             f"before training")
        self.process_group = None

    # ------------------------------------------------------------------ naming
    def _name_of(self, p) -> str:
        name = self._names.get(id(p))
        if name is None:
            i = len(self._order)
            if self._resume is not None:
                if i >= len(self._resume):
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} in a DDP bucket is "
                                     f"not among the {len(self._resume)} parameters of the "
                                     f"pickled GraceState: it was pickled from another model")
                name = self._resume[i]
                want = self._shapes.get(name)
                if want is not None and list(p.shape) != want:
                    raise ValueError(f"parameter {i} of DDP's first bucket layout has shape "
                                     f"{list(p.shape)}; the pickled GraceState's parameter "
                                     f"{name!r} there had {want}: it was pickled from another "
                                     f"model (or another bucket layout)")
            elif self._given_names is None and self._named_unmet:
                raise ValueError("this GraceState was pickled before its first step with "
                                 "named_parameters, whose parameters do not pickle: build a "
                                 "new GraceState(..., named_parameters=...) instead")
            elif self._given_names is not None:
                name = self._given_names.get(id(p))
                if name is None:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} in a DDP bucket "
                                     f"is not in named_parameters: pass the named_parameters "
                                     f"of the module DDP wraps")
            else:
                name = f"param{i}"
            self._names[id(p)] = name
            self._index[name] = i
            self._order.append(name)
            self._shapes[name] = list(p.shape)
        return name

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        """Everything but the process group (and what is keyed by parameter identity)."""
        if self._buckets or self._exchange.units or self._deferred or self._finished:
            raise RuntimeError("a GraceState cannot be pickled in the middle of a step")
        state = dict(self.__dict__)
        group = state.pop("_process_group")
        state.pop("collectives")
        state["_group_ranks"] = self._group_ranks if group is None else \
            list(dist.get_process_group_ranks(group))
        state["_named_unmet"] = self._given_names is not None and not self._order
        state["_names"], state["_given_names"] = {}, None
        state["_bucket_layouts"], state["_streams"] = {}, {}
        return state

    def __setstate__(self, state: dict) -> None:
        """The copy binds the default group when first used (``_bind``), and names the
        parameters it meets by the original's first-met order."""
        self.__dict__.update(state)
        self._process_group, self.collectives = None, None
        # (the streams are not pickled)
        self._per_bucket, self._streams, self._delayed = None, {}, None
        if self._order:
            self._resume = list(self._order)
        self._order, self._index = [], {}
        self._checked = False   # a new DDP: ranks compare again
        if not self.per_parameter and self._layout:
            self._target = [list(g) for g in self._layout]
        self._resumed_on, self._regrouped, self._task = None, False, None

    bucket_name = staticmethod(bucket_name)

    # ------------------------------------------------------------------ agreement
    def _check_ranks_present(self) -> None:
        """Mark in the group's store that this rank reached the grace hook and wait for every
        rank's mark (``agreement_timeout``); ``ValueError`` naming the ranks that never came
        (they run DDP without the hook, or are that much slower to their first backward)."""
        group = self.process_group
        try:
            store = dist.distributed_c10d._get_process_group_store(
                group if group is not None else dist.distributed_c10d._get_default_group())
        except (AttributeError, KeyError, RuntimeError, ValueError):
            return      # no store to look in (another torch): the gather alone checks
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
            tuple(range(dist.get_world_size()))
        seq = _CHECKS[ranks] = _CHECKS.get(ranks, 0) + 1
        me, size = self.collectives.rank(), self.collectives.size()
        keys = [f"grace_dl.ddp.hook/{seq}/rank{r}" for r in range(size)]
        store.set(keys[me], "1")
        try:
            store.wait(keys, datetime.timedelta(seconds=self.agreement_timeout))
            return
        except RuntimeError:        # DistStoreError: a timeout
            pass
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return
        raise ValueError(f"ranks {missing} of the process group did not reach the grace DDP "
                         f"hook within {self.agreement_timeout:g} s of this rank {me}: "
                         f"register grace_dl.torch.ddp.comm_hook on every rank (or on none); "
                         f"if they are only slower to their first backward pass, raise "
                         f"GraceState(agreement_timeout=...)")

    def _check_ranks_agree(self, bucket, names) -> None:
        self._check_ranks_present()
        buffer = bucket.buffer()
        coll = self.collectives

        def allgather(array, name):
            out = coll.synchronize(coll.allgather_async(torch.from_numpy(array)
                                                        .to(buffer.device), name))
            return out.cpu().numpy()

        labels = {"grace configuration": agreement.grace_label(self.grace),
                  "first bucket": [list(names), [list(g.shape) for g in bucket.gradients()],
                                   str(buffer.dtype)],
                  "hook options": {"op": self.op, "granularity": self.granularity,
                                   "piece_bytes": self.piece_bytes}}
        agreement.check(labels, allgather, "grace.ddp.agreement", coll.rank())
        self._checked = True

    # ------------------------------------------------------------------ the step
    # A *unit* is one grace tensor (``grace_dl.communicators.exchange``), its members the
    # parameter names in its order. Its result lands in the bucket by itself where it is
    # sent with the bucket's buffer or a gradient view as ``into``; other units (a resumed
    # run's regrouping) are copied into the gradients' views of the bucket after receive
    # (``_complete``).
    def _piece_sizes(self, tensor):
        """Lengths of the pieces a bucket-granularity unit is sent in (None: sent whole)."""
        if tensor.dim() != 1:
            return None
        if self._piece_bytes == AUTO:
            self._piece_bytes = device_piece_bytes(AUTO, tensor)
        return piece_sizes(tensor.numel(), tensor.element_size(), self._piece_bytes)

    def _layout_of(self, bucket) -> _BucketLayout:
        """``bucket``'s names, its grace tensor's name and its members' sizes, worked out when
        its parameters are new (the first step, DDP's rebuilt buckets), else the kept one."""
        params = bucket.parameters()
        ids = list(map(id, params))
        kept = self._bucket_layouts.get(len(self._buckets))
        if kept is not None and kept[0] == ids and not bucket.buffer().is_sparse:
            return kept[1]
        names = [self._name_of(p) for p in params]
        sparse = [n for n, g in zip(names, bucket.gradients()) if g.is_sparse]
        if sparse or bucket.buffer().is_sparse:
            raise ValueError(f"parameter {(sparse or names)[0]!r} has a sparse gradient "
                             f"(nn.Embedding(sparse=True)?); grace compresses dense tensors: "
                             f"build the module with dense gradients (sparse=False), as the "
                             f"Horovod optimizer's sparse_as_dense=True does")
        real = [(*p.shape, 2) for p in params] if params and params[0].is_complex() else None
        layout = _BucketLayout(names, self.bucket_name(names),
                               [math.prod(s) for s in real] if real else
                               [p.numel() for p in params],
                               self._piece_sizes(bucket.buffer()), real)
        self._bucket_layouts[len(self._buckets)] = (ids, layout)
        return layout

    def _side_stream(self, buffer):
        """The stream a bucket's grace work runs on: where each bucket is finished in its own
        hook call on a GPU (NCCL), a side stream of the bucket's device, made to wait for the
        bucket's gradients, so that the backward pass never waits for a bucket's collectives
        (waiting for a collective makes the waiting stream wait; PyTorch's own hooks finish
        in ``Future.then`` callbacks, which run on streams of a pool); None elsewhere (the
        current stream)."""
        if self.collectives is None:
            self._bind()
        if self._per_bucket is None:
            self._per_bucket = self.collectives.waits_in_stream()
        if not self._per_bucket or buffer.device.type != "cuda":
            return None
        stream = self._streams.get(buffer.device)
        if stream is None:
            stream = self._streams[buffer.device] = torch.cuda.Stream(buffer.device)
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
        return stream

    def _send(self, bucket):
        layout = self._layout_of(bucket)
        if layout.real_shapes is not None:
            bucket = _RealViews(bucket, layout.real_shapes)
        names = layout.names
        if not self._buckets:
            self._task = torch._C._current_graph_task_id()
        if not self._checked:
            self._check_ranks_agree(bucket, names)
        buffer = bucket.buffer()
        devices = [buffer.device] if buffer.device.type == "cuda" else None
        fut = torch.futures.Future(devices=devices)
        started = None if self._powersgd is None else self._powersgd.start(
            bucket, names, layout.numels, self.collectives, f"bucket{len(self._buckets)}")
        if started is not None:
            self._powersgd_buckets.append(started)
        elif self.per_parameter:
            # one fusion group per bucket: each round of its units goes out in one collective
            # per kind and dtype (as powerSGD_hook batches a bucket's P and Q matrices)
            grads = self._views_of(bucket, names)
            group = GroupCollectives(self.collectives, f"ddp.bucket{len(self._buckets)}",
                                     collecting=True, equal_sizes=self._equal_sizes,
                                     counter=self.grace.bytes)
            for g, n in zip(grads, names):
                self._exchange.start(g, n, [n], None, g, None, group)
            group.close()
        elif self._target is not None and names not in self._target:
            # first iteration after a resume, DDP's layout is not the saved one: wait for
            # the whole step and regroup as the checkpointed run did (_complete)
            self._deferred.update(zip(names, self._views_of(bucket, names)))
        elif (self._sums_in_place or self._sums_in_half and buffer.dtype != torch.float16) \
                and layout.pieces is None and self.grace.fusion is None \
                and self._sum_in_place(buffer.detach(), layout):
            pass        # summed in place in DDP's buffer (fp16: its cast, cast back there)
        else:
            # the common step: the bucket's buffer is the one grace tensor, its result
            # written there (no gradient views needed; its members and numels name the
            # step's layout for checkpoints, and are not read back)
            flat = buffer.detach()
            self._exchange.start(flat, layout.name, names, layout.numels, flat,
                                layout.pieces, self.collectives)
        self._buckets.append((fut, buffer))
        if self._per_bucket and self._target is None and not self.collectives.holding():
            self._finish_bucket(fut, buffer)
        return fut

    def _delays(self, bucket) -> bool:
        """Whether ``bucket``, handed over as ``index() == 0`` while this step holds buckets,
        is the next bucket of DDP's *delayed allreduce*: under ``static_graph=True`` DDP's
        first iteration hands every bucket over at the end of the backward pass, each as index
        0 and none as the last (several buckets there only where the parameters have several
        dtypes: a complex or float64 parameter beside float32 ones), and waits for all of them
        before it ends the pass. Each such bucket is therefore finished in its own hook call
        (with those held so far, on the stream they were started on), and the step ends in a
        callback at the end of the backward pass. False (an earlier step left unfinished)
        where the bucket's parameters were handed over already this step (the same bucket 0
        again), or outside a backward pass."""
        ids = set(map(id, bucket.parameters()))
        if self._delayed is None:
            held = {i for p in range(len(self._buckets)) for i in self._bucket_layouts[p][0]}
            if ids & held:
                return False
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_delayed)
            except RuntimeError:    # not in a backward pass
                return False
            self._delayed = held
        elif ids & self._delayed:
            return False
        self._delayed |= ids
        return True

    def _stale(self) -> bool:
        """Whether the buckets this step holds were handed over in an earlier backward pass
        (another autograd graph task) than the bucket now handed over: that pass failed
        before its end (a step of DDP's delayed allreduce whose end-of-pass callback never
        ran, or a step that never handed its last bucket), and its step is to be dropped."""
        return torch._C._current_graph_task_id() != self._task

    def _finish_held(self) -> None:
        """Receive every unit this step has started and complete its buckets' futures, the
        step left open (DDP's delayed allreduce: ``_delays``)."""
        if self._deferred:          # a resumed run's regrouping: the buckets handed over so far
            self._start_deferred()
        units = self._exchange.finish() if self._powersgd is None else self._powersgd_units()
        if self._views:
            self._write_back(units)
        self._finished.extend(units)
        for fut, buffer in self._buckets:
            if not fut.done():
                fut.set_result(buffer)

    def _end_delayed(self) -> None:
        """The end of a step of DDP's delayed allreduce, at the end of its backward pass
        (unless the step failed and was cleared)."""
        if self._delayed is not None:
            self._complete()

    def _views_of(self, bucket, names) -> list:
        """The bucket's gradients, views into its buffer, kept by name for ``_write_back``."""
        grads = [g.detach() for g in bucket.gradients()]
        self._views.update(zip(names, grads))
        return grads

    def _finish_bucket(self, fut, buffer) -> None:
        """Receive the bucket's units now and complete its future (``_per_bucket``; nothing
        is held for the step's read of sizes, so no earlier bucket of the step is pending:
        from the first that holds, all are finished by ``_complete``)."""
        units = self._exchange.finish() if self._powersgd is None else self._powersgd_units()
        if self._views:
            self._write_back(units)
        self._finished.extend(units)
        fut.set_result(buffer)

    def _write_back(self, units) -> None:
        """Copy the results of ``units`` that did not land in the bucket by themselves into
        the gradients' views of it (a resumed run's regrouped first step): one
        ``_foreach_copy_`` for all of them (a few launches on a GPU, not one per gradient)."""
        views = self._views
        dsts, srcs = [], []
        for unit in units:
            if not unit.lands:
                for n, part in zip(unit.members, unit.parts(unit.out)):
                    view = views[n]
                    dsts.append(view)
                    srcs.append(part.reshape(view.shape))
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def _sum_in_place(self, flat, layout) -> bool:
        """Start the allreduce of the bucket, in place, as grace's ``Allreduce`` does without
        a memory, with its bytes counted, without the send path around it: for ``none``
        (``sums_in_place``) the buffer itself, averaged by its postscale; for ``fp16``
        (``sums_in_half``) its float16 cast, whose sum is cast back into the buffer, divided
        by the group's size for an average. False where the engine cannot sum it in place
        (the send path then runs)."""
        coll, grace = self.collectives, self.grace
        size = coll.size()
        average = self.op == AVERAGE
        if self._sums_in_half:
            sent, scale, dtype = flat.to(torch.float16), 1.0, flat.dtype

            def then(summed):
                return assign_div(flat, summed.to(dtype), size if average else None)
        else:
            sent, scale, then = flat, 1.0 / size if average else 1.0, None
        pending = coll.allreduce_async_(sent, grace.wire_name(layout.name, "p0"), scale)
        if pending is None:
            return False
        moved = ring_allreduce_bytes(coll.allreduce_nbytes(sent), size)
        grace.bytes.add(layout.name, moved, moved)
        self._exchange.summed(pending, layout.name, layout.names, layout.numels, coll, then)
        return True

    def _start_deferred(self) -> None:
        """Send the deferred gradients grouped as the saved layout groups them (in its order);
        any left over (parameters the checkpoint did not know) go as one unit."""
        deferred, self._deferred = self._deferred, {}
        self._regrouped = True
        groups = [g for g in self._target if g and all(n in deferred for n in g)]
        rest = sorted(set(deferred) - {n for g in groups for n in g},
                      key=lambda n: -self._index[n])
        for group in [*groups, rest] if rest else groups:
            grads = [deferred[n] for n in group]
            tensor = torch.cat([g.reshape(-1) for g in grads])
            self._exchange.start(tensor, self.bucket_name(group), group,
                                 [g.numel() for g in grads], None, self._piece_sizes(tensor),
                                 self.collectives)

    def _complete(self) -> None:
        try:
            if self._deferred:
                self._start_deferred()
            units = self._exchange.finish() if self._powersgd is None else \
                self._powersgd_units()
            if self._views:         # (only a regrouped or per-parameter step has views)
                self._write_back(units)
            if self._finished:
                units = self._finished + units
            for fut, buffer in self._buckets:
                if not fut.done():
                    fut.set_result(buffer)
            self.grace.end_step()
        except BaseException as err:
            self._clear(err)
            raise
        self.iteration += 1
        names = list(map(_NAME, units))
        if names != self.last_step_names and not self.per_parameter:
            self._forget_vanished(names)
        self.last_step_names = names
        self._layout = list(map(_MEMBERS, units))
        if self._target is not None:
            self._end_regrouping()
        self._buckets, self._deferred, self._views, self._finished = [], {}, {}, []
        self._delayed, self._regrouped = None, False

    def _end_regrouping(self) -> None:
        """After a step of a resumed run: whether its next steps still regroup DDP's buckets
        as the checkpointed run grouped them (``_target``). They do while DDP hands over the
        layout of the first regrouped step: DDP rebuilds its buckets after its first
        iteration, but after its second under ``static_graph`` (whose first iteration is the
        delayed allreduce). A step that needed no regrouping (DDP's layout is the saved one), or
        one of another layout than the first regrouped one (DDP's rebuilt one), ends it."""
        handed = [self._bucket_layouts[p][1].names for p in range(len(self._buckets))]
        if self._regrouped and self._resumed_on in (None, handed):
            self._resumed_on = handed
        else:
            self._target = self._resumed_on = None  # DDP's own (rebuilt) layout from now on

    def _forget_vanished(self, names) -> None:
        """Drop the state of the grace tensors the last step sent and this one did not: DDP's
        first-iteration buckets, which its rebuild replaced by others (another content or
        order: another name). Their state (a residual the size of the bucket) would otherwise
        stay in memory and in every checkpoint, never read again. At the rebuild only (a
        round trip of the state through the host, once); its other slots keep their values."""
        gone = set(self.last_step_names).difference(names)
        if not gone:
            return
        state = self.grace.state_dict()
        kept = without_slots(state, gone, keep=names)
        if unclaimed_keys(state, names) != unclaimed_keys(kept, names):     # some dropped
            self.grace.load_state_dict(kept)

    def _powersgd_units(self) -> list:
        """Finish the buckets started on PowerSGD's bucket path and not yet finished, in the
        order started (what ``Exchange.finish`` does for the others), after those it left to
        the reference composition (``PowerSGDBuckets._layout``); their units."""
        buckets, self._powersgd_buckets = self._powersgd_buckets, []
        units = self._exchange.finish() if self._exchange.units else []
        return units + self._powersgd.exchange(buckets)

    def _clear(self, err=None) -> None:
        """Forget a half-started step's units, futures and views; ``err``: the exception its
        futures not completed yet end with."""
        if err is not None:
            for fut, _ in self._buckets:
                if not fut.done():
                    fut.set_exception(err)
        self._exchange.clear()
        if self.collectives is not None:
            self.collectives.drop_held()
        self._powersgd_buckets = []
        self._buckets, self._deferred, self._views, self._finished = [], {}, {}, []
        self._delayed, self._regrouped = None, False

    # ------------------------------------------------------------------ checkpoints
    def reset(self, name: str | None = None) -> None:
        """Zero the accumulated grace state (error feedback, momenta) of the grace tensor
        ``name`` (one of ``last_step_names``) or of all (``Communicator.reset``); call it on
        every rank, between steps."""
        reset = getattr(self.grace, "reset", None)
        if reset is None:
            raise ValueError(f"{type(self.grace).__name__} has no reset()")
        reset(name)

    def state_dict(self) -> dict:
        """This rank's hook state: the grace state (CPU tensors), the parameter naming, the
        iteration count and the configuration's fingerprint."""
        return {"grace": to_torch(self.grace.state_dict()),
                "granularity": self.granularity, "per_parameter": self.per_parameter,
                "op": self.op, "piece_bytes": self._piece_bytes, "iteration": self.iteration,
                "names": list(self._order),
                "layout": [list(g) for g in self._layout], **self._identity()}

    def _identity(self) -> dict:
        """The configuration's fingerprint, and this rank and the group's size where the
        process group is up (``exchange.check_saved``)."""
        known = dist.is_initialized() and self.collectives is not None
        return {"fingerprint": self.grace.fingerprint(),
                "rank": self.collectives.rank() if known else None,
                "size": self.collectives.size() if known else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; raises ``ValueError`` if it was written for another grace
        configuration, granularity, op or pieces, or by another rank or group size."""
        if not isinstance(state, dict) or "grace" not in state:
            raise ValueError(f"not a GraceState state_dict (keys "
                             f"{sorted(state) if isinstance(state, dict) else type(state)}); "
                             f"expected keys include 'grace' and 'fingerprint'")
        check_saved(state, self._identity(), self.grace,
                    "save state.state_dict() on every rank and load each rank's own",
                    lenient=("rank", "size"))
        # the pieces name the state: a checkpoint with other pieces is refused (one written
        # before pieces existed has no piece_bytes and loads; an unresolved "auto" on either
        # side takes the other's: module docstring, *Pieces*)
        saved = state.get("piece_bytes", self._piece_bytes)
        pieces = saved if self._piece_bytes == AUTO else self._piece_bytes
        for key, mine in (("per_parameter", self.per_parameter), ("op", self.op),
                          ("piece_bytes", pieces)):
            theirs = state.get(key, mine)
            if theirs != mine and not (key == "piece_bytes" and theirs == AUTO):
                raise ValueError(f"state_dict was written with {key}={theirs!r}, this "
                                 f"state has {key}={mine!r}")
        if self._buckets:
            raise RuntimeError("load_state_dict() called in the middle of a step")
        self._piece_bytes = pieces
        self.grace.load_state_dict(to_numpy(state["grace"]))
        self.iteration = int(state.get("iteration", 0))
        layout = state.get("layout") or None
        self._target = None if self.per_parameter or layout is None else \
            [list(g) for g in layout]
        self._resumed_on = None


def comm_hook(state: GraceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress and send ``bucket`` through ``state.grace``; the
    returned future resolves to the bucket's averaged gradients (see the module docstring)."""
    if not isinstance(state, GraceState):
        raise ValueError(f"comm_hook's state must be a grace_dl.torch.ddp.GraceState, got "
                         f"{type(state).__name__}")
    if bucket.index() == 0 and state._buckets and state._stale():
        state._clear()      # (DDP dropped that step's futures with its failed pass)
    elif bucket.index() == 0 and state._buckets and not state._delays(bucket):
        state._clear()
        raise RuntimeError("a DDP step started before the previous one handed over its last "
                           "bucket; the grace hook expects every bucket of a step in order")
    # (the stream is the side one where buckets are finished one by one: ``_per_bucket``
    # True, or unknown until the first bucket; the futures' events are recorded on it)
    side = state._side_stream(bucket.buffer()) if state._per_bucket is not False else None
    with _CURRENT_STREAM if side is None else torch.cuda.stream(side):
        try:
            fut = state._send(bucket)
        except BaseException as err:
            # a refusal (sparse gradient, ranks that disagree): leave no half-started step
            state._clear(err)
            raise
        if bucket.is_last():
            state._complete()
        elif state._delayed is not None:
            try:
                state._finish_held()
            except BaseException as err:
                state._clear(err)
                raise
    return fut


#: ``comm_hook``'s stream context where it runs on the current stream
_CURRENT_STREAM = contextlib.nullcontext()
