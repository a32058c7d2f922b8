"""``ops.pack_ragged`` / ``ops.unpack_ragged``: a gather of parts whose lengths differ across
ranks, each rank's block its lengths then its parts' bytes (what Horovod sends for a payload of
data-dependent size, ``Collectives.allgather_parts_async``). Three ranks' blocks joined as a
gather joins them are cut back into every rank's parts, in torch and in TF (eager and inside
``tf.function``, where no size is known), whatever the parts' dtypes and alignments. Which
sends may leave a ragged payload whole for the exchange of sizes to cut
(``Call.exchanges_sizes``), and the check of the lengths a path gives for it."""

from __future__ import annotations

import numpy as np
import pytest

from grace_dl.tensorflow import ops as tf_ops
from grace_dl.torch import ops as torch_ops

DTYPES = ["float32", "uint8", "int64", "bool", "float16"]


def _parts(rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s parts: lengths that differ by rank (an empty one on rank 1), odd byte
    counts before the wider dtypes, so they start off their alignment in the block."""
    rng = np.random.default_rng(rank)
    n = [2 * rank + 1, 3 + rank, 0 if rank == 1 else rank + 2, 5 - rank, rank + 1]
    return [rng.standard_normal(n[0]).astype(np.float32),
            rng.integers(0, 255, n[1]).astype(np.uint8),
            rng.integers(-2 ** 40, 2 ** 40, n[2]).astype(np.int64),
            rng.integers(0, 2, n[3]).astype(bool),
            rng.standard_normal(n[4]).astype(np.float16)]


def test_torch_blocks_cut_back_into_every_ranks_parts():
    import torch

    ranks = [[torch.from_numpy(p) for p in _parts(r)] for r in range(3)]
    blocks = [torch_ops.pack_ragged(parts) for parts in ranks]
    assert [b.dtype for b in blocks] == [torch.uint8] * 3
    assert blocks[0].numel() == 4 * len(DTYPES) + sum(p.numel() * p.element_size()
                                                      for p in ranks[0])
    pieces = torch_ops.unpack_ragged(torch.cat(blocks), DTYPES, 3)
    for i in range(len(DTYPES)):
        for r in range(3):
            assert pieces[i][r].dtype == ranks[r][i].dtype
            assert torch.equal(pieces[i][r], ranks[r][i]), (i, r)


def test_torch_refuses_a_gather_its_counts_do_not_add_up_to():
    import torch

    block = torch_ops.pack_ragged([torch.arange(3, dtype=torch.float32)])
    with pytest.raises(ValueError, match=r"2 ragged blocks of 1 parts \(\['float32'\]\) holds "
                                         r"28 bytes; its blocks' counts say 32"):
        torch_ops.unpack_ragged(torch.cat([block, block[:-4]]), ["float32"], 2)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_tf_blocks_cut_back_into_every_ranks_parts(traced):
    import tensorflow as tf

    ranks = [_parts(r) for r in range(3)]

    def joined_and_cut(*flat):
        parts = [list(flat[r * len(DTYPES):(r + 1) * len(DTYPES)]) for r in range(3)]
        gathered = tf.concat([tf_ops.pack_ragged(p) for p in parts], axis=0)
        return tf_ops.unpack_ragged(gathered, DTYPES, 3)

    run = joined_and_cut
    if traced:  # every part's length unknown while tracing, as a gather's are
        run = tf.function(joined_and_cut, input_signature=[
            tf.TensorSpec([None], tf.as_dtype(p.dtype)) for parts in ranks for p in parts])
    pieces = run(*[tf.constant(p) for parts in ranks for p in parts])
    for i in range(len(DTYPES)):
        for r in range(3):
            got = pieces[i][r].numpy()
            assert got.dtype == ranks[r][i].dtype and np.array_equal(got, ranks[r][i]), (i, r)


def test_a_payload_is_left_whole_only_for_a_gathering_communicators_own_sends():
    """``Call.exchanges_sizes``: allgather and two-phase exchange a ragged payload's lengths
    themselves, so a path may leave its payload whole (signSGD's on a GPU); not broadcast,
    not a compressor of equal sizes, not a subclass that changed what a payload is or how it
    is sent (it would send or count the whole buffer)."""
    from grace_dl.communicators.allgather import Allgather
    from grace_dl.communicators.broadcast import Broadcast
    from grace_dl.communicators.twophase import TwoPhase
    from grace_dl.registry import lookup

    signs, none = lookup("compressor", "signsgd"), lookup("memory", "none")
    assert Allgather(signs(), none()).exchanges_sizes
    assert TwoPhase(signs(), none()).exchanges_sizes
    assert not Broadcast(signs(), none()).exchanges_sizes
    assert not Allgather(lookup("compressor", "qsgd")(), none()).exchanges_sizes
    for base, method in ((Allgather, "compress"), (Allgather, "issue"),
                         (TwoPhase, "_recompress"), (TwoPhase, "complete")):
        inherited = getattr(base, method)

        def own(self, *args, _inherited=inherited):     # (a function of its own)
            return _inherited(self, *args)

        mine = type("Mine", (base,), {method: own})
        assert not mine(signs(), none()).exchanges_sizes, (base.__name__, method)


def test_sent_lengths_must_be_one_a_part():
    """A path's ``sent_lengths`` of another length than the payload's parts is refused with
    both counts, by the default collectives and by torch.distributed's."""
    import torch

    from support import OneRank

    parts = [torch.zeros(4, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)]
    one = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="one a part: 2 parts, 1 lengths"):
        OneRank().allgather_parts_async(parts, ["a", "b"], "len", one)
    with pytest.raises(ValueError, match="one a part: 2 parts, 1 lengths"):
        OneRank().alltoall_parts_async(parts, one, "a2a")


def test_held_collectives_are_issued_in_order_after_one_read_of_their_sizes():
    """An engine that holds sizes (``Collectives.holds_sizes``: on NCCL, or Horovod's for
    sizes on a GPU) issues nothing until the first wait for a held collective, then reads
    every held size table at once (one host read) and issues them in the order made; a
    collective whose issue failed makes the ones held with it say so when waited for."""
    import torch
    from sync_guard import guarded

    from grace_dl.collectives import issued
    from support import OneRank

    class Holding(OneRank):
        def holds_sizes(self, lengths):
            return True

    coll, order = Holding(), []
    first = coll.sized(torch.tensor([2, 3]),
                       lambda c: (order.append(("first", c)) or "first's", None))
    second = coll.sized(lambda: torch.tensor([5]),
                        lambda c: (order.append(("second", c)) or "second's", c))
    assert coll.holding() and order == []
    with guarded() as guard:
        assert issued(second) == "second's"
    assert [what for what, _ in guard.calls] == ["tolist"]
    assert order == [("first", [2, 3]), ("second", [5])] and not coll.holding()
    assert second.splits == [5] and first.splits is None
    assert issued(first) == "first's" and len(order) == 2      # (issued once)
    failing = coll.sized(torch.tensor([1]), lambda c: (1 / 0, None))
    later = coll.sized(torch.tensor([1]), lambda c: ("later", None))
    with pytest.raises(ZeroDivisionError):
        issued(failing)
    with pytest.raises(RuntimeError, match="never issued"):
        issued(later)
