"""grace_dl.communicators.agreement with a simulated allgather: every rank's check runs the
same collectives and raises the same error."""

import threading

import numpy as np

from grace_dl.communicators import agreement


def run_ranks(labels_by_rank):
    """Each rank's outcome of ``agreement.check``: one thread per rank, and an allgather that
    waits for every rank's array under the same name, then concatenates them in rank order."""
    n = len(labels_by_rank)
    barrier = threading.Barrier(n, timeout=10)
    pool: dict[str, dict[int, np.ndarray]] = {}
    outcomes, names = [None] * n, [[] for _ in range(n)]

    def rank_main(rank):
        def gather(array, name):
            names[rank].append(name)
            pool.setdefault(name, {})[rank] = array
            barrier.wait()
            out = np.concatenate([pool[name][r] for r in range(n)])
            barrier.wait()
            return out
        try:
            agreement.check(labels_by_rank[rank], gather, "t", rank)
        except ValueError as err:
            outcomes[rank] = str(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(x == names[0] for x in names)  # the same collectives on every rank
    return outcomes


def test_equal_labels_pass_with_one_collective():
    labels = {"grace configuration": {"fingerprint": "abc"}, "parameters": [["w", [2, 3]]]}
    assert run_ranks([labels, labels, labels]) == [None, None, None]


def test_grace_on_some_ranks_only_names_them_on_every_rank():
    grace = {"grace configuration": {"fingerprint": "abc"}, "parameters": [["w", [2]]]}
    none = {"grace configuration": None}
    out = run_ranks([grace, none, grace])
    for rank, msg in enumerate(out):
        assert msg.startswith("ranks disagree on the grace configuration: ranks [0, 2] have "
                              "{'fingerprint': 'abc'}, ranks [1] have grace=None"), msg
        assert f"this is rank {rank}" in msg
        assert "parameters" not in msg  # only what the grace=None rank cannot state


def test_different_tensor_lists_name_the_differing_entries():
    a = {"grace configuration": "x", "gradients": [["a", [4]], ["b", [4]]]}
    b = {"grace configuration": "x", "gradients": [["a", [4]]]}
    out = run_ranks([a, b])
    assert out[0] == out[1].replace("this is rank 1", "this is rank 0")
    assert "ranks disagree on the gradients: only ranks [0] have ['[\"b\", [4]]'], only ranks " \
           "[1] have []" in out[0]


def test_custom_mismatch_message_is_raised_on_every_rank():
    calls = []

    def mismatch(everyone, rank):
        calls.append(rank)
        return f"custom: {[e['k'] for e in everyone]} seen by rank {rank}"

    labels = [{"k": 1}, {"k": 2}]
    results = [None, None]
    barrier = threading.Barrier(2, timeout=10)
    pool: dict = {}

    def rank_main(rank):
        def gather(array, name):
            pool.setdefault(name, {})[rank] = array
            barrier.wait()
            out = np.concatenate([pool[name][0], pool[name][1]])
            barrier.wait()
            return out
        try:
            agreement.check(labels[rank], gather, "t", rank, mismatch=mismatch)
        except ValueError as err:
            results[rank] = str(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["custom: [1, 2] seen by rank 0", "custom: [1, 2] seen by rank 1"]
