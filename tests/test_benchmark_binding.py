"""The benchmarks bind each rank to cores of its own (benchmarks/bind.py): the share each rank
gets, and real launches (local horovodrun, horovodrun and torchrun over emulated hosts) whose
ranks report the cores they run on."""

import os
import subprocess
import sys

import pytest

from benchmarks.bind import cores_for, rank_and_size
from benchmarks.jobs import local_horovodrun, worker_env
from benchmarks.network import EmulatedCluster

REPORT = ("import os; print('CORES', os.environ.get('HOROVOD_RANK', os.environ.get('RANK')), "
          "','.join(map(str, sorted(os.sched_getaffinity(0)))))")
ALL = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("rank,size,cores,expected", [
    (0, 2, [0, 1], [0]), (1, 2, [0, 1], [1]),
    (1, 2, [0, 1, 2, 3], [2, 3]), (0, 3, [0, 1, 2, 3], [0]), (2, 3, [0, 1, 2, 3], [2]),
    (3, 4, [0, 1], [1]), (2, 4, [4, 7], [4]), (0, 1, [0, 1], [0, 1])])
def test_each_rank_gets_an_equal_share_or_a_core_round_robin(rank, size, cores, expected):
    assert cores_for(rank, size, cores) == expected


@pytest.mark.parametrize("rank,size", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_its_job_is_an_error(rank, size):
    with pytest.raises(ValueError, match=f"rank {rank} is outside a job of size {size}"):
        cores_for(rank, size, [0, 1])


def test_rank_and_size_come_from_whichever_launcher_started_the_process():
    assert rank_and_size({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}) == (1, 2)
    assert rank_and_size({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}) == (0, 4)
    assert rank_and_size({"RANK": "3", "WORLD_SIZE": "4"}) == (3, 4)
    assert rank_and_size({"RANK": "3"}) is None
    assert rank_and_size({}) is None


def _reported(stdout: str) -> dict:
    return {int(rank): [int(c) for c in cores.split(",")]
            for _, rank, cores in (line.split()[-3:] for line in stdout.splitlines()
                                   if "CORES" in line)}


@pytest.mark.multiproc
@pytest.mark.parametrize("bind", [True, False])
def test_local_horovodrun_binds_each_rank_unless_told_not_to(bind):
    proc = subprocess.run(local_horovodrun([sys.executable, "-c", REPORT], 2, bind=bind),
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = {r: cores_for(r, 2, ALL) if bind else ALL for r in range(2)}
    assert _reported(proc.stdout) == expected


@pytest.mark.multiproc
def test_ranks_on_emulated_hosts_are_bound_under_horovodrun_and_torchrun():
    with EmulatedCluster(2, mbit=1000, prefix="gracebind", subnet_id=79) as cluster:
        env = worker_env(cluster.env())
        proc = subprocess.run(cluster.horovodrun([sys.executable, "-c", REPORT]), env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert _reported(proc.stdout) == {r: cores_for(r, 2, ALL) for r in range(2)}

        script = os.path.join(os.path.dirname(__file__), "workers", "report_cores.py")
        procs = [subprocess.Popen(cmd, env={**env, "GLOO_SOCKET_IFNAME": "eth0"},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd in cluster.torchrun([script], port=29517)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        assert _reported("".join(outs)) == {r: cores_for(r, 2, ALL) for r in range(2)}
