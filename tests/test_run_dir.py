"""The run directory of a launcher that was killed with SIGKILL is removed by the next start."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile

from common.transport import RUN_DIR_PREFIX, make_run_dir, remove_stale_run_dirs
from tests.server_process import ServerProcess, pid_alive, wait_until


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_dead_launchers_run_directory_is_removed_and_a_live_ones_is_kept(tmp_path):
    dead = tmp_path / f"clearserve-{dead_pid()}-abc"
    alive = tmp_path / f"clearserve-{os.getpid()}-def"
    other = tmp_path / "clearserve-notapid"
    for folder in (dead, alive, other):
        folder.mkdir()
        (folder / "socket").write_text("")
    assert remove_stale_run_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists()


def test_a_run_directory_is_private_and_named_after_its_launcher():
    path = make_run_dir()
    try:
        assert os.path.basename(path).startswith(f"clearserve-{os.getpid()}-")
        assert os.stat(path).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(path)


def test_a_launcher_killed_with_sigkill_takes_its_children_along_and_the_next_start_removes_its_run_directory(
    null_gpt2, tmp_path
):
    flags = ("--load-format", "null", "--tokenizer-workers", "1")
    srv = ServerProcess(null_gpt2, *flags, log_path=tmp_path / "server.log")
    try:
        pids = srv.child_pids()
        [run_dir] = glob.glob(os.path.join(tempfile.gettempdir(), f"{RUN_DIR_PREFIX}{srv.proc.pid}-*"))
        srv.proc.kill()
        srv.proc.wait()
        wait_until(lambda: not any(pid_alive(p) for p in pids.values()), timeout=10, what="the children to die too")
        assert os.path.isdir(run_dir)  # no clean-up of its own survives a SIGKILL
        os.rmdir(make_run_dir())  # what the next launcher does first
        assert not os.path.exists(run_dir)
    finally:
        srv.stop(signal.SIGKILL)
