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
    from grace_dl.strategy import from_spec

    spec, momentum = recipe(family)
    grc = from_spec(spec, {"w": (64, 128), "b": (128,), "out": (128, 10)}, steps_per_epoch=21)
    assert problems(grc, momentum) == []
    assert problems(grc, 0.9) == [] or momentum == 0.0


def test_topk_recipe_warms_up_dense_then_compresses_only_large_weights():
    from grace_dl.strategy import from_spec

    grc = from_spec(recipe("topk")[0], {"w": (64, 128), "b": (128,), "out": (128, 10)},
                    steps_per_epoch=21)
    assert [start for start, _ in grc.stages] == [0, 21]
    assert type(grc.stages[0][1].compressor).__name__ == "NoneCompressor"
    sparse = grc.stages[1][1]
    assert type(sparse.communicator("w").compressor).__name__ == "TopKCompressor"
    for small in ("b", "out"):
        assert type(sparse.communicator(small).compressor).__name__ == "NoneCompressor"
        assert type(sparse.communicator(small).memory).__name__ == "MomentumMemory"


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


@pytest.mark.parametrize("spec, kwargs, words", [
    (3, {}, ["spec must be a dict", "3"]),
    ({"schedule": [(0, {})]}, {}, ["'schedule' must be a dict"]),
    ({"schedule": {"x": {}}}, {}, ["schedule key 'x'"]),
    ({"schedule": {"0": {}, "1e": {}}}, {}, ["'1e' counts epochs", "steps_per_epoch"]),
    ({"schedule": {"0": {}, "-1e": {}}}, {"steps_per_epoch": 5}, ["'-1e'"]),
    ({"size_threshold": {"min_elements": 10, "params": {}}}, {}, ["needs the model"]),
    ({"size_threshold": 10}, {"named_parameters": {"w": (4, 4)}}, ["SizeThreshold arguments"]),
    ({"compressor": "topq"}, {}, ["topq"]),
])
def test_from_spec_refuses_bad_specs_naming_them(spec, kwargs, words):
    from grace_dl.strategy import from_spec

    with pytest.raises(ValueError) as err:
        from_spec(spec, **kwargs)
    for word in words:
        assert word in str(err.value)
