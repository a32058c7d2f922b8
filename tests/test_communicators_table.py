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
    single = c.rounds == 1
    return {"allreduce": c.allreduce_safe and c.equal_sizes,
            "allgather": single,
            "broadcast": single,
            "twophase": single and c.two_phase_safe and c.equal_sizes}[comm]


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
    class Odd:
        rounds, allreduce_safe, two_phase_safe, equal_sizes = 3, False, False, True

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
