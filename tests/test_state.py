"""Per-name state: the framework that created a slot owns it; tensor names claim their slots."""

import numpy as np
import pytest
import tensorflow as tf
import torch

from grace_dl import grace_from_params


@pytest.mark.parametrize("first,second", [("torch", "tensorflow"), ("tensorflow", "torch")])
@pytest.mark.parametrize("params", [
    {"compressor": "topk", "memory": "residual", "communicator": "allgather",
     "compress_ratio": 0.5},
    {"compressor": "signum", "communicator": "allgather"},
    {"compressor": "qsgd", "communicator": "allgather"}])
def test_one_name_fed_torch_then_tf_raises_a_clear_error(first, second, params):
    grc = grace_from_params(params)
    make = {"torch": lambda: torch.ones(8), "tensorflow": lambda: tf.ones(8)}
    x = make[first]()
    grc.memory.compensate(x, "w")
    grc.compressor.compress(x, "w")
    with pytest.raises(ValueError, match=f"created for {first} tensors and is now used with "
                                         f"{second} ones"):
        y = make[second]()
        grc.compressor.compress(grc.memory.compensate(y, "w"), "w")
    # other names are free to use the other framework
    payload, ctx = grc.compressor.compress(make[second](), "other")
    assert np.isfinite(np.asarray(grc.compressor.decompress(payload, ctx))).all()


def test_unclaimed_keys_and_without_slots_follow_names_in_nested_state():
    from grace_dl.state import unclaimed_keys, without_slots

    state = {"memory": {"a": np.zeros(2), "b": np.ones(2)},
             "compressor": {"step/a/chunk0": np.zeros(()), "step/b/chunk0": np.zeros(()),
                            "epoch": 3},
             "server/a/chunk0": np.zeros(2)}
    assert sorted(unclaimed_keys(state, ["b"])) == ["compressor/step/a/chunk0", "memory/a",
                                                    "server/a/chunk0"]
    kept = without_slots(state, ["a"])
    assert unclaimed_keys(kept, ["b"]) == []
    assert kept["compressor"]["epoch"] == 3 and kept["memory"]["b"] is state["memory"]["b"]
    # a slot of a dropped name that a kept name also claims stays
    assert "a" in without_slots({"a": np.zeros(1)}, ["a"], keep=["a"])
