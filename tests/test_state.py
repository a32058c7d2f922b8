"""Per-name state belongs to the framework that created it."""

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
