"""``from_strategy`` without Horovod: what it refuses at construction, and the checks a send
makes before any collective. Its collectives are tested in test_strategy_multiproc.py."""

import numpy as np
import pytest
import torch

from grace_dl.strategy import from_strategy, from_text, strategy_pb2
from grace_dl.strategy.dispatcher import StrategyDispatcher
from grace_dl.strategy.pipeline import Pipeline
from support import OneRank

TOPK = {"compressor": "topk", "compress_ratio": 0.5, "memory": "residual",
        "communicator": "allgather"}


def _strategy(*nodes, replicas=()):
    s = strategy_pb2.Strategy(version=1)
    s.graph_config.replicas.extend(replicas)
    for name, shape, params, group in nodes:
        n = s.node_config.add(var_name=name)
        n.shape.extend(shape)
        n.AllReduceSynchronizer.group = group
        Pipeline.from_params(params).write(n)
    return s


def test_routes_and_shared_pipelines():
    s = _strategy(("w1", (4, 4), TOPK, 0), ("w2", (4, 4), TOPK, 1), ("b", (4,), {}, 2))
    d = from_strategy(s)
    assert d.communicator("w1") is d.communicator("w2")  # one communicator per pipeline
    assert d.communicator("b") is not d.communicator("w1")
    assert d.communicator("w1").bytes is d.bytes is d.communicator("b").bytes
    assert d.pipeline("w1").label() == "topk(compress_ratio=0.5)+residual+allgather"
    assert d.node("w1:0").name == "w1"  # TF tensor names with ':0' resolve too
    assert sorted(d.state_dict()) == ["none+none+allreduce",
                                      "topk(compress_ratio=0.5)+residual+allgather"]


def test_unknown_gradient_name_lists_the_variables():
    d = from_strategy(_strategy(("w", (2,), {}, 0), ("b", (2,), {}, 1)))
    with pytest.raises(ValueError, match=r"'nope' has no node.*\['w', 'b'\]"):
        d.send(torch.zeros(2), "nope")


def test_checks_before_any_collective():
    s = _strategy(("w", (2, 3), {}, 0))
    g = s.node_config.add(var_name="g").AllReduceSynchronizer
    g.spec, g.group = strategy_pb2.AllReduceSynchronizer.NCCL, 1
    d = from_strategy(s)
    with pytest.raises(ValueError, match=r"shape \(3, 2\), its strategy node says \(2, 3\)"):
        d.send(torch.zeros(3, 2), "w")
    with pytest.raises(ValueError, match="spec NCCL .* host memory"):
        d.send(torch.zeros(5), "g")
    with pytest.raises(ValueError, match="op must be one of"):
        d.send(torch.zeros(2, 3), "w", op="max")


def test_check_variables_names_both_directions():
    d = from_strategy(_strategy(("fc.weight", (4, 8), {}, 0), ("old.bias", (4,), {}, 1)))
    model = torch.nn.Linear(8, 4)
    model = torch.nn.ModuleDict({"fc": model})
    with pytest.raises(ValueError) as err:
        d.check_variables(model.named_parameters())
    msg = str(err.value)
    assert "variables with no node in the strategy: ['fc.bias']" in msg
    assert "nodes naming no variable of the model: ['old.bias']" in msg
    with pytest.raises(ValueError, match=r"shapes differ: \['fc.weight \(strategy \(4, 8\), "
                                         r"model \(8, 8\)\)'\]"):
        d.check_variables({"fc.weight": (8, 8), "old.bias": (4,)})
    d.check_variables(["fc.weight", "old.bias"])
    with pytest.raises(ValueError, match="no node in the strategy"):
        from_strategy(_strategy(("a", (1,), {}, 0)), variables={"a": (1,), "b": (2,)})


PS_NODE = 'node_config {{ var_name: "w" PSSynchronizer {{ {} }} }} version: 1'


@pytest.mark.parametrize("text, match", [
    (PS_NODE.format("sync: false"), "sync=false .* not supported"),
    (PS_NODE.format("sync: true staleness: 2"), "staleness=2 is not supported"),
    (PS_NODE.format('sync: true reduction_destination: "gpu-box"'),
     "neither a rank number nor one of graph_config.replicas"),
    ('node_config { var_name: "w" partitioner: "1,2" AllReduceSynchronizer {} }',
     "partitioning .* not supported"),
    ('node_config { var_name: "w" }', "has no synchronizer"),
    ('node_config { var_name: "w" AllReduceSynchronizer {} }'
     'node_config { var_name: "w" AllReduceSynchronizer { group: 1 } }', "more than one node"),
    ('version: 9 node_config { var_name: "w" AllReduceSynchronizer {} }', "version 9 is newer"),
    ('', "has no nodes"),
    ('node_config { var_name: "w" AllReduceSynchronizer { compressor: HorovodCompressor } '
     'compressor { name: "topk" } communicator { name: "allgather" } }', "set only one"),
    ('node_config { var_name: "w" PSSynchronizer { sync: true } '
     'communicator { name: "allgather" } }', "leave it unset"),
    ('node_config { var_name: "w" AllReduceSynchronizer {} compressor { name: "topk" } }',
     "communicator 'allreduce' cannot carry compressor 'topk'"),
    ('node_config { var_name: "w" AllReduceSynchronizer {} compressor { name: "topk" '
     'params { key: "k" value { int_value: 3 } } } communicator { name: "allgather" } }',
     r"takes no parameter\(s\) \['k'\]"),
])
def test_bad_strategies_raise_at_construction(text, match):
    with pytest.raises(ValueError, match=match):
        from_strategy(from_text(text))


def test_groups_must_be_homogeneous():
    with pytest.raises(ValueError, match="group 0 mixes pipelines: 'a' has "
                                         "topk.*'b' has none"):
        from_strategy(_strategy(("a", (4,), TOPK, 0), ("b", (4,), {}, 0)))


def test_bucket_groups_are_listed_routed_and_not_fused():
    """A group with ``bucket`` set: listed in ready order (reverse node order), routed under its
    bucket name with its total size, not a fusion group; lone bucket nodes stay plain."""
    from grace_dl.communicators.buckets import bucket_name

    s = _strategy(("a", (4, 4), TOPK, 0), ("b", (4,), TOPK, 0), ("c", (3,), TOPK, 1))
    for node in s.node_config:
        node.AllReduceSynchronizer.bucket = True
    grc = from_strategy(s)
    assert grc.buckets == [["b", "a"]]
    route = grc.node(bucket_name(["b", "a"]))
    assert route.shape == (20,) and route.comm is grc.communicator("a")
    assert not grc.communicator("a").fusion
    grc.check_variables({"a": (4, 4), "b": (4,), "c": (3,)})  # buckets are not variables


def test_bucket_groups_need_every_node_flagged_and_a_flat_compressor():
    s = _strategy(("a", (4,), TOPK, 0), ("b", (4,), TOPK, 0))
    s.node_config[1].AllReduceSynchronizer.bucket = True
    with pytest.raises(ValueError, match="group 0: 'b' has bucket=True, 'a' has "
                                         "bucket=False; every node of a bucket sets it"):
        from_strategy(s)
    s.node_config[0].AllReduceSynchronizer.bucket = True   # the other way round
    s.node_config[1].AllReduceSynchronizer.bucket = False
    with pytest.raises(ValueError, match="group 0: 'b' has bucket=False, 'a' has "
                                         "bucket=True; every node of a bucket sets it"):
        from_strategy(s)
    powersgd = {"compressor": "powersgd", "memory": "powersgd"}
    s = _strategy(("a", (4, 4), powersgd, 0), ("b", (4, 4), powersgd, 0))
    for node in s.node_config:
        node.AllReduceSynchronizer.bucket = True
    with pytest.raises(ValueError, match="group 0 is a bucket, but its compressor 'powersgd' "
                                         "needs each variable's shape"):
        from_strategy(s)


def test_twophase_fuses_and_rides_ring_like_any_communicator():
    """Two-phase's later phases are ordinary phases of the one send path, so a group of
    two-phase nodes fuses (its gathers go out at once, its all-to-alls unfused) and spec RING
    moves its payloads through host memory."""
    twophase = {"communicator": "twophase"}
    grc = from_strategy(_strategy(("a", (4,), twophase, 0), ("b", (4,), twophase, 0)))
    assert grc.communicator("a").fusion.groups == {"g0": ["a", "b"]}
    s = _strategy(("a", (4,), twophase, 0))
    s.node_config[0].AllReduceSynchronizer.spec = strategy_pb2.AllReduceSynchronizer.RING
    from_strategy(s)


def test_ps_destination_by_replica_name():
    s = from_text('node_config { var_name: "w" PSSynchronizer { sync: true '
                  'reduction_destination: "b:GPU:0" } } graph_config { replicas: "a:GPU:0" '
                  'replicas: "b:GPU:0" } version: 1')
    d = from_strategy(s)
    assert d.node("w").root == 1
    assert sorted(d.state_dict()) == ["none+none+ps@1"]


def test_fingerprint_tracks_content_not_identity():
    a = _strategy(("w", (4, 4), TOPK, 0))
    b = _strategy(("w", (4, 4), TOPK, 0))
    b.id, b.path = "another-build", "/tmp/elsewhere.pbtxt"
    assert from_strategy(a).fingerprint() == from_strategy(b).fingerprint()
    c = _strategy(("w", (4, 4), {**TOPK, "compress_ratio": 0.25}, 0))
    assert from_strategy(a).fingerprint() != from_strategy(c).fingerprint()
    d = _strategy(("w", (4, 4), TOPK, 1))
    assert from_strategy(a).fingerprint() != from_strategy(d).fingerprint()


def test_state_dict_round_trip_and_unknown_pipelines():
    d = from_strategy(_strategy(("w", (4,), TOPK, 0)))
    key = "topk(compress_ratio=0.5)+residual+allgather"
    residual = np.arange(4, dtype=np.float32)
    d.load_state_dict({key: {"compressor": {}, "memory": {"w": residual}}})
    assert np.array_equal(d.state_dict()[key]["memory"]["w"], residual)
    with pytest.raises(ValueError, match=r"pipelines \['fp16\+none\+allreduce'\]"):
        d.load_state_dict({"fp16+none+allreduce": {}})


def test_process_set_reaches_every_pipeline():
    d = StrategyDispatcher(_strategy(("w", (4,), TOPK, 0), ("b", (4,), {}, 1)))
    marker = object()
    d.process_set = marker
    assert {d.communicator(n).process_set for n in ("w", "b")} == {marker}


@pytest.mark.parametrize("params", [{}, TOPK, {"communicator": "twophase", "compressor": "qsgd"},
                                    {"compressor": "powersgd", "memory": "powersgd"}])
def test_send_receive_on_an_explicit_engine_in_node_order(params):
    """The dispatcher's send path is the core's: handles come back (fused group included),
    a second receive is refused, and none compresses nothing away."""
    shapes = {"a": (8, 4), "b": (6,), "c": (5, 3)}
    d = from_strategy(_strategy(*[(n, s, params, 0) for n, s in shapes.items()]))
    d._verified = True  # one process: nothing to agree with
    xs = {n: torch.arange(float(np.prod(s))).reshape(s) for n, s in shapes.items()}
    handles = {n: d.send(x, n, collectives=OneRank()) for n, x in reversed(list(xs.items()))}
    outs = {n: d.receive(h) for n, h in handles.items()}
    assert set(outs) == set(shapes)
    for n, out in outs.items():
        assert tuple(out.shape) == shapes[n]
        if not params:
            assert torch.equal(out, xs[n])
    with pytest.raises(ValueError, match="already received"):
        d.receive(handles["a"])


def test_buckets_add_into_the_routed_communicators_residual():
    """``accumulator`` under a dispatcher: the slot of the communicator ``name`` is routed to
    (the torch optimizer's buckets add their gradients there), the same results as sending
    the whole tensor; None for a node without a residual."""
    from grace_dl.communicators.base import accumulator

    nodes = (("w", (4, 4), TOPK, 0), ("b", (4,), {}, 1))
    plain, parts = from_strategy(_strategy(*nodes)), from_strategy(_strategy(*nodes))
    plain._verified = parts._verified = True    # one process: nothing to agree with
    assert accumulator(parts, "b", torch.zeros(4)) is None
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 4, generator=g)
        want = plain.receive(plain.send(x.clone(), "w", collectives=OneRank())).clone()
        slot = accumulator(parts, "w", x)
        slot.view(-1)[:7].add_(x.view(-1)[:7])
        slot.view(-1)[7:].add_(x.view(-1)[7:])
        got = parts.receive(parts.send(torch.full_like(x, float("nan")), "w",
                                       collectives=OneRank()))
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        plain.end_step()
        parts.end_step()
