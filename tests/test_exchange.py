"""grace_dl.communicators.exchange: a step's units, started one by one and finished in
lockstep, give each unit the result its tensor gets through the grace object alone (whole, in
pieces, or split into members), land where they were sent into, and leave nothing behind for
the next step. The glues' own behaviour over it (DDP, Horovod torch, TF) is tested with real
multi-rank runs in test_ddp, test_torch_optimizer, test_tensorflow_horovod and the comm matrix."""

import pytest
import torch

from grace_dl import grace_from_params
from grace_dl.communicators.exchange import Exchange, check_saved
from support import OneRank

PARAMS = {"compressor": "qsgd", "memory": "residual", "communicator": "allgather",
          "quantum_num": 16, "seed": 3}


def tensors():
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, generator=gen), "b": torch.randn(4, 5, generator=gen),
            "c": torch.randn(7, generator=gen)}


def reference(t, name):
    """What ``t`` sent alone as ``name`` through a fresh grace object gives."""
    grc = grace_from_params(PARAMS)
    return grc.receive(grc.send(t.clone(), name, collectives=OneRank()))


def test_each_unit_gets_what_its_tensor_gets_alone_whole_in_pieces_or_in_members():
    ts, coll = tensors(), OneRank()
    exchange = Exchange(grace_from_params(PARAMS), "average")
    whole = exchange.start(ts["b"].clone(), "b", ["b"], None, None, None, coll)
    flat = ts["a"].clone()
    pieces = exchange.start(flat, "a", ["a"], None, flat, [100, 100, 100], coll)
    joined = torch.cat([ts["b"].reshape(-1), ts["c"]])
    members = exchange.start(joined, "bc", ["b", "c"], [20, 7], None, None, coll)
    assert [u.name for u in exchange.units] == ["b", "a", "bc"]
    assert (whole.lands, pieces.lands, members.lands) == (False, True, False)
    assert len(pieces.handles) == 3

    units = exchange.finish()
    assert units == [whole, pieces, members] and exchange.units == []
    torch.testing.assert_close(whole.out, reference(ts["b"], "b"), rtol=0, atol=0)
    # pieces: each its own grace tensor a/piece<i>, the result in the tensor sent from
    assert pieces.out is flat
    for i in range(3):
        torch.testing.assert_close(flat[100 * i:100 * (i + 1)],
                                   reference(ts["a"][100 * i:100 * (i + 1)], f"a/piece{i}"),
                                   rtol=0, atol=0)
    b, c = members.parts(members.out)
    want = reference(joined, "bc")
    torch.testing.assert_close(torch.cat([b, c]), want, rtol=0, atol=0)
    assert (b.numel(), c.numel()) == (20, 7)
    assert whole.parts(whole.out) == [whole.out]


def test_finish_receives_in_the_order_given_and_forgets_every_unit():
    received = []

    class Recording:
        """A ``grace=`` object with only send and receive (the protocol): receive_each falls
        back to one receive after the other."""

        def send(self, tensor, name, op="average", collectives=None, into=None):
            return (name, tensor)

        def receive(self, handle, into=None):
            received.append(handle[0])
            return handle[1] * 2

    exchange = Exchange(Recording(), "sum")
    x, y = exchange.start(torch.ones(2), "x"), exchange.start(torch.ones(3), "y")
    done = exchange.finish([y, x])
    assert received == ["y", "x"] and done == [y, x]
    torch.testing.assert_close(x.out, torch.full((2,), 2.0))
    assert exchange.units == [] and len(exchange.pending) == 0
    assert exchange.finish() == []          # the next step starts empty


def test_summed_units_are_waited_on_through_their_collectives():
    class Waits(OneRank):
        waited = []

        def synchronize(self, handle):
            self.waited.append(handle)
            return handle + 1

    coll = Waits()
    exchange = Exchange(grace_from_params({"compressor": "none", "memory": "none",
                                           "communicator": "allreduce"}), "average")
    unit = exchange.summed(torch.zeros(3), "bucket0", ["w"], [3], coll)
    assert unit.lands and unit.handles == []
    exchange.finish()
    assert len(coll.waited) == 1
    torch.testing.assert_close(unit.out, torch.ones(3))


def test_clear_drops_a_half_started_step():
    exchange = Exchange(grace_from_params(PARAMS), "average")
    exchange.start(torch.ones(4), "w", collectives=OneRank())
    exchange.clear()
    assert exchange.units == [] and exchange.finish() == []


def test_advance_completes_finished_exchanges_early_with_the_same_result():
    class AnyOrder(OneRank):
        any_order = True        # as Horovod's: ranks may complete in any order

        def done(self, handle):
            return True

    t = tensors()["a"]
    exchange = Exchange(grace_from_params(PARAMS), "average")
    assert exchange.advance(None) == 0
    unit = exchange.start(t.clone(), "a", collectives=AnyOrder())
    assert exchange.advance(unit) == 1          # its one round completed, result kept
    assert len(exchange.pending) == 0
    exchange.finish()
    torch.testing.assert_close(unit.out, reference(t, "a"), rtol=0, atol=0)


def test_check_saved_refuses_another_configuration_size_or_rank_naming_both():
    grc = grace_from_params(PARAMS)
    mine = {"fingerprint": grc.fingerprint(), "size": 2, "rank": 1}
    check_saved(dict(mine), mine, grc)                              # its own: loads
    lenient = ("size", "rank")                                      # (the DDP hook's)
    check_saved({"fingerprint": grc.fingerprint()}, mine, grc, lenient=lenient)  # older
    check_saved(dict(mine, rank=None), dict(mine), grc, lenient=lenient)  # rank unknown then
    with pytest.raises(ValueError, match=r"a job of None ranks; this job has 2"):
        check_saved({"fingerprint": grc.fingerprint()}, mine, grc)  # strict by default
    with pytest.raises(ValueError, match=r"is for configuration abc, this grace is "
                                         + grc.fingerprint()):
        check_saved(dict(mine, fingerprint="abc"), mine, grc)
    with pytest.raises(ValueError, match=r"a job of 4 ranks; this job has 2"):
        check_saved(dict(mine, size=4), mine, grc)
    with pytest.raises(ValueError, match=r"written by rank 0, this is rank 1: .*per rank; "
                                         r"load your own"):
        check_saved(dict(mine, rank=0), mine, grc, "load your own")


def test_ddp_refuses_another_ranks_or_group_sizes_state():
    import torch.distributed as dist

    from grace_dl.torch import ddp as grace_ddp

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        state = grace_ddp.GraceState(grace_from_params(PARAMS))
        # (gloo: a bucket's collectives are waited for by the host, so the hook completes
        # the step's buckets together, not each in its own call as on NCCL)
        assert not state.collectives.waits_in_stream()
        saved = state.state_dict()
        assert (saved["rank"], saved["size"]) == (0, 1)
        state.load_state_dict(saved)
        with pytest.raises(ValueError, match=r"written by rank 1, this is rank 0"):
            state.load_state_dict(dict(saved, rank=1))
        with pytest.raises(ValueError, match=r"a job of 2 ranks; this job has 1"):
            state.load_state_dict(dict(saved, size=2))
        state.load_state_dict({k: v for k, v in saved.items() if k not in ("rank", "size")})
    finally:
        if created:
            dist.destroy_process_group()
