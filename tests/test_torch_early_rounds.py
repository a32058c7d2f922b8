"""DistributedOptimizer(early_rounds=...): the gradient hooks complete the exchanges whose
collectives have finished (``Router.advance``), in a 2-rank horovodrun job
(tests/workers/torch_early.py): the same parameters bit for bit as completing everything in
``synchronize()``, phases really completed in the backward pass, none on a fusion group's
collectives; and the flag is checked."""

import numpy as np
import pytest

import mp

N = 2
MULTI = ("powersgd", "signsgd-2phase", "qsgd-2phase", "signsgd-2phase-pieces", "strategy",
         "schedule")
SINGLE = ("topk", "randomk", "topk-buckets", "signsgd")


@pytest.fixture(scope="module")
def ranks():
    return mp.run("torch_early.py", np=N, timeout=300)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [*MULTI, *SINGLE, "qsgd-2phase-grouped"])
def test_early_completion_gives_the_same_parameters(ranks, name):
    for res in ranks:
        early, late = res[name]["early"]["params"], res[name]["late"]["params"]
        assert early.keys() == late.keys()
        for k in early:
            assert np.array_equal(early[k], late[k]), (name, k)
        assert res[name]["late"]["early_per_step"] == [0, 0, 0]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["signsgd-2phase", "signsgd"])
def test_sizes_held_for_the_steps_one_read_give_the_same_parameters(ranks, name):
    """signSGD on the device path, its data-dependent sizes held until the step's first wait
    (as on a GPU: ``Collectives.holds_sizes``): the parameters of the path CPU tensors take,
    bit for bit; a held phase cannot finish early, so none does; the six tensors' sizes are
    read together in ``synchronize()``, once a round (two-phase: two)."""
    rounds = 2 if name.endswith("2phase") else 1
    for res in ranks:
        held = res[f"{name}-held"]
        for when in ("early", "late"):
            for k, value in res[name][when]["params"].items():
                assert np.array_equal(held[when]["params"][k], value), (name, when, k)
            assert held[when]["early_per_step"] == [0, 0, 0]
            assert held[when]["reads_per_step"] == [rounds] * 3, held[when]
        assert res[name]["late"]["reads_per_step"] == [0, 0, 0]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", MULTI)
def test_later_rounds_start_in_the_backward_pass(ranks, name):
    """Three layers, a pause between them: the last two layers' first phases finish while the
    backward pass goes on, so their next phases (and those after) start in hooks; every
    rank, every step."""
    for res in ranks:
        assert all(n >= 2 for n in res[name]["early"]["early_per_step"]), \
            (name, res[name]["early"]["early_per_step"])


@pytest.mark.multiproc
@pytest.mark.parametrize("name", SINGLE)
def test_finished_single_round_results_are_built_in_the_backward_pass(ranks, name):
    for res in ranks:
        assert all(n >= 1 for n in res[name]["early"]["early_per_step"]), \
            (name, res[name]["early"]["early_per_step"])


@pytest.mark.multiproc
def test_fusion_groups_complete_in_synchronize(ranks):
    """A fusion group's collectives go out together on its own engine: never advanced early."""
    for res in ranks:
        assert res["qsgd-2phase-grouped"]["early"]["early_per_step"] == [0, 0, 0]


def test_early_rounds_must_be_a_flag():
    import torch

    import grace_dl.torch.horovod as hvd
    from grace_dl import grace_from_params

    model = torch.nn.Linear(2, 2)
    grc = grace_from_params({"compressor": "none", "memory": "none",
                             "communicator": "allreduce"})
    with pytest.raises(ValueError, match=r"early_rounds must be True or False, got 1"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), grace=grc,
                                 early_rounds=1)
