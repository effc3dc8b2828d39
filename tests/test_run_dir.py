"""The run directory of a launcher that was killed with SIGKILL is removed by the next start."""

from __future__ import annotations

import os
import subprocess
import sys

from common.transport import make_run_dir, remove_stale_run_dirs


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
