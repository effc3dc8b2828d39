"""A spawned child is tied to its parent before it imports its role's module (common/process.py run_spawned, the
target of every role launch.py starts and of the grammar compile worker): a parent killed while the child is still
importing (torch, xgrammar: seconds) leaves nothing running, and the child's role never starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server_process import ROOT

# A role's module whose import lasts until the test releases it (as torch's lasts seconds on a busy machine).
SLOW_ROLE = """
import os, time
open(os.environ["SLOW_ROLE_IMPORTING"], "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["SLOW_ROLE_RELEASE"]) and time.monotonic() < deadline:
    time.sleep(0.02)

def main(path):
    open(path, "w").write("the role ran")
"""

# A parent that starts the role as launch.py does, prints its pid, and waits for it.
PARENT = """
import multiprocessing as mp, os, sys
from common.process import run_spawned
if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=run_spawned, args=(os.getpid(), "slow_role:main", sys.argv[1]))
    child.start()
    print(child.pid, flush=True)
    child.join()
"""


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie no one has reaped yet is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dying with the parent is Linux's PR_SET_PDEATHSIG")
def test_a_child_still_importing_its_role_dies_with_its_parent(tmp_path):
    (tmp_path / "slow_role.py").write_text(SLOW_ROLE)
    importing, release, ran = tmp_path / "importing", tmp_path / "release", tmp_path / "ran"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "SLOW_ROLE_IMPORTING": str(importing),
        "SLOW_ROLE_RELEASE": str(release),
    }
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(ran)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert wait_for(importing.exists, 30), "the child never began importing its role"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_for(lambda: not running(child), 5), "the child outlived its parent"
    finally:
        release.touch()  # a child that survived ends its import, sees its parent gone and exits
        parent.kill()
    assert not ran.exists()
