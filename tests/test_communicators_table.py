"""Single-process checks of the communicators: which compressors each one carries (every pair
of registered compressor x communicator), the errors for the others, chunking, and the
two-phase server state in checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from grace_dl.communicators import wire
from grace_dl.registry import BUILTIN, lookup, names

COMMUNICATORS = ["allreduce", "allgather", "broadcast", "twophase"]


def _accepts(comm: str, c) -> bool:
    """What each communicator promises to carry, from the compressor's declarations."""
    single = c.caps.rounds == 1
    return {"allreduce": c.caps.allreduce_safe and c.caps.equal_sizes,
            "allgather": single,
            "broadcast": single,
            "twophase": single and c.caps.two_phase_safe}[comm]


def test_every_builtin_compressor_and_communicator_imports():
    for kind in ("compressor", "communicator"):
        for name in BUILTIN[kind]:
            lookup(kind, name)
    assert set(COMMUNICATORS) <= set(names("communicator"))


@pytest.mark.parametrize("comp", sorted(BUILTIN["compressor"]))
@pytest.mark.parametrize("comm", COMMUNICATORS)
def test_pair_is_accepted_or_refused_at_construction(comm, comp):
    compressor = lookup("compressor", comp)()
    memory = lookup("memory", "none")()
    cls = lookup("communicator", comm)
    if _accepts(comm, compressor):
        built = cls(compressor, memory)
        assert built.compressor is compressor and built.name == comm
        return
    with pytest.raises(ValueError) as err:
        cls(compressor, memory)
    message = str(err.value)
    assert f"communicator {comm!r}" in message and f"compressor {comp!r}" in message
    carriers = [c for c in COMMUNICATORS if _accepts(c, compressor)]
    assert carriers, f"no communicator carries {comp}"
    for other in carriers:
        assert repr(other) in message  # says what would work instead
    assert message.count("instead") == 1


def test_every_compressor_has_a_carrier():
    for comp in BUILTIN["compressor"]:
        compressor = lookup("compressor", comp)()
        assert wire.carriers(compressor), comp


def test_refusal_without_any_carrier_says_so():
    from grace_dl.compressors.base import Capabilities

    class Odd:
        caps = Capabilities(rounds=3)

    with pytest.raises(ValueError, match="no registered communicator carries it"):
        lookup("communicator", "allgather").check_compressor(Odd())


@pytest.mark.parametrize("numel,size,expected", [
    (35, 4, [9, 9, 9, 8]), (3, 4, [1, 1, 1]), (8, 2, [4, 4]), (1, 4, [1]), (5, 1, [5])])
def test_chunk_sizes(numel, size, expected):
    assert wire.chunk_sizes(numel, size) == expected


def test_ring_allreduce_bytes():
    assert wire.ring_allreduce_bytes(1000, 1) == 0
    assert wire.ring_allreduce_bytes(1000, 2) == 1000
    assert wire.ring_allreduce_bytes(1000, 4) == 1500


def test_twophase_server_state_round_trips_and_option_is_checked():
    twophase = lookup("communicator", "twophase")
    comm = twophase(lookup("compressor", "none")(), lookup("memory", "residual")())
    saved = {"compressor": {}, "memory": {"w": np.ones(3, np.float32)},
             "server": {"w/chunk0": np.arange(2, dtype=np.float32)}}
    comm.load_state_dict(saved)
    out = comm.state_dict()
    np.testing.assert_array_equal(out["server"]["w/chunk0"], np.arange(2))
    np.testing.assert_array_equal(out["memory"]["w"], np.ones(3))
    assert comm.config()["server_error_feedback"] is True
    with pytest.raises(ValueError, match="server_error_feedback must be True or False, got 'no'"):
        twophase(lookup("compressor", "none")(), lookup("memory", "none")(),
                 server_error_feedback="no")


def test_grace_from_params_reaches_twophase_option():
    from grace_dl import grace_from_params

    comm = grace_from_params({"compressor": "none", "communicator": "twophase",
                              "server_error_feedback": False})
    assert comm.server_error_feedback is False


@pytest.mark.parametrize("comm", ["allgather", "broadcast", "twophase"])
def test_pack_parts_option_is_checked_routed_and_agreed_on(comm):
    from grace_dl import grace_from_params

    cls = lookup("communicator", comm)
    assert cls(lookup("compressor", "qsgd")(), lookup("memory", "none")()).pack_parts is True
    built = grace_from_params({"compressor": "qsgd", "communicator": comm, "pack_parts": False})
    assert built.pack_parts is False and built.config()["pack_parts"] is False
    for bad in ("no", 1, None):
        with pytest.raises(ValueError, match=f"pack_parts must be True or False, got {bad!r}"):
            cls(lookup("compressor", "qsgd")(), lookup("memory", "none")(), pack_parts=bad)


def _packed_round_trip(tensor_of, to_numpy):
    """Parts of several dtypes (an int64 part after a 3-element float32 one starts off its
    width) packed, gathered as two ranks' segments and cut back: the same bits, the same
    bytes."""
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(3).astype(np.float32), np.arange(-2, 3, dtype=np.int64),
             np.array([7, 255, 0], np.uint8), rng.standard_normal(2).astype(np.float16)]
    flats = [tensor_of(p) for p in parts]
    assert wire.packable(flats) and not wire.packable(flats[:1])
    layout = wire.layout(flats)
    buffer = wire.pack(flats)
    assert to_numpy(buffer).dtype == np.uint8
    assert to_numpy(buffer).size == sum(p.nbytes for p in parts) == sum(n for _, n in layout)
    from grace_dl.backend import ops_for

    two = ops_for(buffer).cat([buffer, buffer])
    pieces = wire.unpack_all(two, [layout, [], layout])
    assert len(pieces) == len(parts) and all(len(p) == 2 for p in pieces)
    for want, got in zip(parts, pieces):
        for rank in range(2):
            out = to_numpy(got[rank])
            assert out.dtype == want.dtype
            np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


def test_packed_parts_round_trip_torch():
    import torch

    _packed_round_trip(torch.from_numpy, lambda t: t.numpy())


def test_packed_parts_round_trip_tensorflow():
    import tensorflow as tf

    _packed_round_trip(tf.constant, lambda t: t.numpy())


def test_bool_parts_are_not_packed():
    import torch

    assert not wire.packable([torch.zeros(2), torch.zeros(3, dtype=torch.bool)])
