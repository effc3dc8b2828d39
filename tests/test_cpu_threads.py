"""Each process's compute threads: the GPU workers split the cores, every other process takes 1, idle threads
sleep (a CPU forward's after a short spin), and an OMP_NUM_THREADS, OMP_WAIT_POLICY or GOMP_SPINCOUNT the launcher
was given wins."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from common.cpu_threads import SHORT_SPIN, forward_on_cpu, gpu_worker_threads, spawned_with_threads
from launch import parse_args


@pytest.mark.parametrize(("cores", "gpu_workers", "each"), [(2, 1, 2), (16, 4, 4), (8, 3, 2), (2, 4, 1)])
def test_gpu_workers_split_the_cores_at_least_one_each(cores, gpu_workers, each):
    assert gpu_worker_threads(cores, gpu_workers) == each


VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def _child_threads(queue) -> None:
    queue.put(tuple(os.environ.get(name) for name in VARIABLES))


def spawn_and_read_threads(threads: int, short_spin: bool = True) -> tuple[str | None, str | None, str | None]:
    """The child's OMP_NUM_THREADS, OMP_WAIT_POLICY and GOMP_SPINCOUNT."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_child_threads, args=(queue,))
    with spawned_with_threads(threads, short_spin):
        process.start()
    answer = queue.get(timeout=60)
    process.join()
    return answer


def test_a_child_spawned_with_a_share_starts_with_it_and_the_launcher_keeps_its_own(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # Idle compute threads sleep instead of spinning on; a CPU forward's after a short spin that bridges its ops.
    assert spawn_and_read_threads(3) == ("3", "PASSIVE", SHORT_SPIN)
    assert spawn_and_read_threads(3, short_spin=False) == ("3", "PASSIVE", None)
    assert not any(name in os.environ for name in VARIABLES)


def test_the_forward_runs_on_the_cpu_where_asked_or_where_no_nvidia_device_is(monkeypatch):
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert forward_on_cpu("cpu") and not forward_on_cpu("cuda") and not forward_on_cpu("auto")
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert forward_on_cpu("auto") and not forward_on_cpu("cuda")


def test_an_omp_num_threads_given_to_the_launcher_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert spawn_and_read_threads(3) == ("1", "PASSIVE", SHORT_SPIN)


def test_an_omp_wait_policy_given_to_the_launcher_wins_and_keeps_its_own_spinning(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert spawn_and_read_threads(3)[1:] == ("ACTIVE", None), "a spin count would cap an ACTIVE policy's spinning"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_spin_count_given_to_the_launcher_wins(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert spawn_and_read_threads(3)[1:] == ("PASSIVE", "0")
    assert os.environ["GOMP_SPINCOUNT"] == "0"


def test_cpu_threads_must_be_at_least_one(capsys):
    assert parse_args(["--cpu-threads", "4"]).cpu_threads == 4
    with pytest.raises(SystemExit):
        parse_args(["--cpu-threads", "0"])
    assert "--cpu-threads must be at least 1" in capsys.readouterr().err
