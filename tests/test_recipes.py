"""``grace_dl.recipes``: the per-family recipes build, and the combinations known to diverge
under momentum are named (the torch optimizer's warning is checked under horovodrun in
tests/test_schedule.py)."""

from __future__ import annotations

import pytest

from grace_dl import Schedule, grace_from_params
from grace_dl.recipes import RECIPES, optimizer_momentum, problems, recipe

RANDK = {"compressor": "randomk", "compress_ratio": 0.1, "communicator": "allreduce"}


@pytest.mark.parametrize("family", sorted(RECIPES))
def test_every_recipe_builds_and_has_no_known_problem(family):
    params, momentum = recipe(family)
    grc = grace_from_params(params)
    assert problems(grc, momentum) == []


def test_unknown_family_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"family must be one of \['powersgd', 'qsgd', "
                                         r"'randomk', 'topk'\], got 'sign'"):
        recipe("sign")


def test_randomk_with_error_feedback_under_momentum_is_named():
    grc = grace_from_params({**RANDK, "memory": "residual"})
    found = problems(grc, 0.9)
    assert len(found) == 1 and "known to diverge" in found[0] and "unbiased=True" in found[0]
    assert problems(grc, 0.0) == []


def test_unbiased_randomk_needs_no_error_feedback_and_no_optimizer_momentum():
    grc = grace_from_params({**RANDK, "unbiased": True, "memory": "residual"})
    assert any("grows without bound" in p for p in problems(grc, 0.0))
    plain = grace_from_params({**RANDK, "unbiased": True})
    assert any("known to diverge" in p for p in problems(plain, 0.9))
    assert problems(plain, 0.0) == []


def test_momentum_in_memory_and_optimizer_is_applied_twice():
    grc = grace_from_params({"compressor": "topk", "communicator": "allgather",
                             "memory": "dgc"})
    assert any("applied twice" in p for p in problems(grc, 0.9))
    assert problems(grc, 0.0) == []


def test_schedule_stages_are_each_checked():
    grc = Schedule({0: {"compressor": "none"}, 5: {**RANDK, "memory": "residual"}})
    assert len(problems(grc, 0.9)) == 1


def test_optimizer_momentum_reads_param_groups():
    assert optimizer_momentum([{"momentum": 0.0}, {"momentum": 0.9}]) == 0.9
    assert optimizer_momentum([{"lr": 0.1}]) == 0.0
