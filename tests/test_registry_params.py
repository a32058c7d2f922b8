"""Registry and grace_from_params: names resolve, bad input fails with the accepted values."""

import numpy as np
import pytest
import tensorflow as tf
import torch

from grace_dl import Capabilities, Compressor, grace_from_params, lookup, names, register_compressor
from grace_dl.backend import framework_of, ops_for
from grace_dl.registry import BUILTIN
from grace_dl.state import State


def test_every_builtin_name_is_listed():
    for kind in BUILTIN:
        assert set(BUILTIN[kind]) <= set(names(kind))


def test_unknown_compressor_names_the_accepted_ones():
    with pytest.raises(ValueError) as err:
        grace_from_params({"compressor": "tpok"})
    msg = str(err.value)
    assert "'tpok'" in msg and "topk" in msg and "qsgd" in msg


def test_unknown_memory_and_communicator():
    with pytest.raises(ValueError, match="unknown memory 'residul'.*residual"):
        grace_from_params({"memory": "residul"})
    with pytest.raises(ValueError, match="unknown communicator 'allreduse'.*allgather"):
        grace_from_params({"communicator": "allreduse"})


def test_unknown_parameter_is_named_with_the_accepted_keys():
    with pytest.raises(ValueError) as err:
        grace_from_params({"compressor": "none", "memory": "residual", "betta": 0.5})
    msg = str(err.value)
    assert "betta" in msg and "beta" in msg and "gamma" in msg


def test_out_of_range_value_is_named():
    with pytest.raises(ValueError, match=r"gamma must be in \(0.0, inf\], got 0"):
        grace_from_params({"memory": "residual", "gamma": 0})


def test_seed_reaches_random_compressors_and_every_pipeline_accepts_it():
    assert grace_from_params({"compressor": "qsgd", "communicator": "allgather",
                              "seed": 3}).compressor.seed == 3
    assert grace_from_params({"compressor": "randomk", "compress_ratio": 0.1,
                              "seed": 4}).compressor.seed == 4
    grace_from_params({"compressor": "none", "seed": 3, "world_size": 2})  # nothing to seed


def test_residual_memory_scales_the_residual_by_beta_and_the_gradient_by_gamma():
    grc = grace_from_params({"compressor": "topk", "compress_ratio": 0.25, "memory": "residual",
                             "communicator": "allgather", "beta": 0.5, "gamma": 2.0})
    comp, mem = grc.compressor, grc.memory
    g = [torch.tensor([4.0, -1.0, 0.5, 2.0]), torch.tensor([0.0, 3.0, -2.0, 1.0])]
    x1 = mem.compensate(g[0], "w")
    assert torch.equal(x1, 2.0 * g[0])  # no residual yet
    payload, ctx = comp.compress(x1, "w")
    mem.update(x1, "w", comp, payload, ctx)
    residual = x1 - comp.decompress(payload, ctx)  # top-1 of 4 kept: 8.0
    assert torch.equal(residual, torch.tensor([0.0, -2.0, 1.0, 4.0]))
    assert torch.equal(mem.compensate(g[1], "w"), 0.5 * residual + 2.0 * g[1])


def test_params_must_be_a_dict():
    with pytest.raises(ValueError, match="params must be a dict"):
        grace_from_params(["compressor", "none"])


def test_defaults_and_exposed_parts():
    grc = grace_from_params({"communicator": "allgather", "memory": "residual", "beta": 0.5})
    assert type(grc.compressor).__name__ == "NoneCompressor"
    assert grc.memory.beta == 0.5
    assert grc.name == "allgather"


def test_user_subclass_registers_by_name():
    @register_compressor("test_scale_by_two")
    class ScaleByTwo(Compressor):
        caps = Capabilities(allreduce_safe=True)

        def compress(self, tensor, name):
            return [tensor * 2], None

        def decompress(self, payload, ctx):
            return payload[0] / 2

    assert lookup("compressor", "test_scale_by_two") is ScaleByTwo
    assert "test_scale_by_two" in names("compressor")
    grc = grace_from_params({"compressor": "test_scale_by_two", "communicator": "allreduce"})
    assert isinstance(grc.compressor, ScaleByTwo)
    with pytest.raises(ValueError, match="already registered"):
        register_compressor("test_scale_by_two")(type("Other", (ScaleByTwo,), {}))


def test_a_capability_declared_outside_caps_is_refused():
    """Before ``caps`` a compressor declared ``allreduce_safe = True`` in its class; such a
    flag would now be ignored, so the class is refused when it is defined."""
    with pytest.raises(TypeError, match=r"\['allreduce_safe', 'average'\] as class attributes.*"
                                        r"caps = grace_dl.Capabilities\(allreduce_safe=..., "
                                        r"average=...\)"):
        class Old(Compressor):
            allreduce_safe = True
            average = False


def test_backend_is_chosen_from_the_tensor_type():
    assert framework_of(torch.zeros(1)) == "torch"
    assert framework_of(tf.zeros(1)) == "tensorflow"
    assert framework_of(tf.Variable(1.0)) == "tensorflow"
    assert ops_for(torch.zeros(1)).NAME == "torch"
    with pytest.raises(TypeError, match="supports torch.Tensor and tf.Tensor"):
        framework_of(np.zeros(1))


@pytest.mark.parametrize("make", [torch.ones, lambda s: tf.ones(s)], ids=["torch", "tf"])
def test_state_loaded_before_first_use_is_applied_on_creation(make):
    x = make((2, 3))
    ops = ops_for(x)
    saved = State()
    ops.assign(saved.zeros("w", ops, x), x * 3)
    assert saved.next_step("step/w", ops) == 1
    assert saved.next_step("step/w", ops) == 2
    snapshot = saved.state_dict()

    fresh = State()
    fresh.load_state_dict(snapshot)          # nothing created yet: held until first use
    np.testing.assert_array_equal(ops.to_numpy(ops.read(fresh.zeros("w", ops, x))),
                                  np.full((2, 3), 3.0))
    assert fresh.next_step("step/w", ops) == 3
