"""The typed contracts: both ops backends match ``OpsBackend`` name for name and parameter for
parameter, every built-in ``grace=`` object is a ``Grace``, one send path, one parameter
routing."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import grace_dl.tensorflow.ops as tf_ops
import grace_dl.torch.ops as torch_ops
from grace_dl import grace_from_params
from grace_dl.contracts import Grace, OpsBackend, check_grace
from grace_dl.registry import names

ROOT = Path(__file__).resolve().parent.parent


def _public(module) -> dict:
    return {n: getattr(module, n) for n in dir(module)
            if not n.startswith("_") and callable(getattr(module, n))
            and not inspect.isclass(getattr(module, n))
            and not inspect.ismodule(getattr(module, n))
            and getattr(getattr(module, n), "__module__", "") != "typing"}


def _params(fn):
    """Parameter names and defaults of a function grace_dl wrote; None for a framework's own
    function re-exported as is (``torch.abs``, ``tf.abs``), whose signature is not ours."""
    if not getattr(fn, "__module__", "").startswith("grace_dl"):
        return None
    sig = inspect.signature(fn)
    return [(p.name, p.default) for p in sig.parameters.values() if p.name != "self"]


PROTOCOL = {n: f for n, f in vars(OpsBackend).items()
            if callable(f) and not n.startswith("_")}


@pytest.mark.parametrize("module", [torch_ops, tf_ops], ids=["torch", "tensorflow"])
def test_ops_module_defines_exactly_the_protocol(module):
    assert set(_public(module)) == set(PROTOCOL)


@pytest.mark.parametrize("name", sorted(PROTOCOL))
def test_ops_signatures_agree_across_backends_and_protocol(name):
    want = _params(PROTOCOL[name])
    for module in (torch_ops, tf_ops):
        got = _params(getattr(module, name))
        if got is not None:
            assert got == want, f"{module.__name__}.{name}{got} != OpsBackend.{name}{want}"


@pytest.mark.parametrize("communicator", names("communicator"))
def test_every_communicator_is_a_grace_object(communicator):
    grc = grace_from_params({"communicator": communicator})
    assert isinstance(grc, Grace)
    check_grace(grc)


def test_the_strategy_dispatcher_is_a_grace_object():
    from grace_dl.strategy import Uniform, from_strategy

    assert isinstance(from_strategy(Uniform({"compressor": "fp16"}).build({"w": (4,)})), Grace)


def test_check_grace_names_what_is_missing():
    class Half:
        def send(self, tensor, name):
            return None

    with pytest.raises(ValueError, match=r"Half lacks \['receive', 'synchronize'"):
        check_grace(Half())


def test_one_send_path():
    """Only the base class defines ``send``: communicators and the dispatcher inherit it; a
    ``Schedule``'s ``send`` hands the tensor to its running stage's."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for d in ("communicators", "strategy")
            for p in sorted((ROOT / "grace_dl" / d).glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if "def send(" in line]
    schedule = [h for h in hits if h.startswith("grace_dl/communicators/schedule.py:")]
    assert len(schedule) == 1, hits
    hits.remove(schedule[0])
    assert hits == ["grace_dl/communicators/base.py:" + hits[0].split(":")[1]], hits
    import inspect

    from grace_dl.communicators.schedule import Schedule

    assert "stage.send(tensor, name, op, collectives, into)" in inspect.getsource(Schedule.send)


@pytest.mark.parametrize("params", [
    {"compressor": "fp16", "seed": 1},
    {"compressor": "topk", "memory": "residual", "communicator": "allgather",
     "compress_ratio": 0.05, "seed": 3, "world_size": 2},
    {"compressor": "signum", "memory": "dgc", "communicator": "allgather", "momentum": 0.5},
    {"compressor": "qsgd", "communicator": "twophase", "server_error_feedback": False},
])
def test_grace_from_params_and_a_pipeline_route_a_dict_alike(params):
    from grace_dl.strategy.pipeline import Pipeline

    direct = grace_from_params(params)
    via_strategy = Pipeline.from_params(params).build()
    assert direct.config() == via_strategy.config()


@pytest.mark.parametrize("params,match", [
    ({"compressor": "fp16", "ratio": 0.1}, r"unknown parameter\(s\) \['ratio'\]"),
    ({"compressor": "nope"}, "unknown compressor 'nope'"),
])
def test_grace_from_params_and_a_pipeline_refuse_a_dict_alike(params, match):
    from grace_dl.strategy.pipeline import Pipeline

    with pytest.raises(ValueError, match=match):
        grace_from_params(params)
    with pytest.raises(ValueError, match=match):
        Pipeline.from_params(params)
