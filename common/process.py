"""What every child process does first: name itself and its logs, die with its parent, exit cleanly on SIGTERM."""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from common.messages import WorkerReady

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
PROCESS_NAME_BYTES = 15  # the kernel keeps 16 bytes, the last a NUL


def run_spawned(parent_pid: int, entry: str, *args: object) -> None:
    """A spawned child's first code: the Process's target wherever a role is started (launch.py, the grammar
    compile worker), with the role's own entry point as `entry` ("module:function", entry_point_of). It ties the
    child to its parent before the role's module is imported: spawn imports a target's module before running any
    of it, and a role's imports (torch, xgrammar) take seconds, in which a parent stopped or killed would leave the
    child running until they end."""
    _die_with_parent(parent_pid)
    module, _, function = entry.partition(":")
    getattr(importlib.import_module(module), function)(*args)


def entry_point_of(function: Callable[..., object]) -> str:
    """run_spawned's name for a module-level function."""
    return f"{function.__module__}:{function.__qualname__}"


def init_child_process(role: str, log_level: str, parent_pid: int) -> None:
    """Call first thing in a child's entry point."""
    _die_with_parent(parent_pid)
    _name_process(role)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops everyone
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    configure_logging(role, log_level)
    _thread_lock_for_progress_bars()


def configure_logging(role: str, log_level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"%(asctime)s.%(msecs)03d %(levelname)s [{role} pid={os.getpid()}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def _die_with_parent(parent_pid: int) -> None:
    # Linux: the kernel sends SIGKILL to this process when its parent dies, even by SIGKILL. Without it a
    # killed launcher would leave orphans holding the GPU.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _name_process(role: str) -> None:
    # Every child is `python -c "from multiprocessing.spawn ..."` in its command line; its name (what top,
    # `ps -o comm`, pgrep and py-spy's process list show) says which role it plays: pgrep -x frontend-0.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, role.encode()[:PROCESS_NAME_BYTES], 0, 0, 0)


def _thread_lock_for_progress_bars() -> None:
    # tqdm (transformers' "Loading weights" bar) guards its output with a multiprocessing semaphore by default,
    # registered with the launcher's resource tracker; a child ends with os._exit, so the tracker found it
    # unreleased and warned "leaked semaphore objects" at every shutdown. One process's threads are all a
    # child's bars need to agree with.
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


class _SigtermDeferral:
    """How many sigterm_deferred() blocks are open, and whether a SIGTERM came during one."""

    depth = 0
    pending = False


def _exit_on_sigterm(signum, frame) -> None:
    if _SigtermDeferral.depth:
        _SigtermDeferral.pending = True
        return
    raise SystemExit(0)


@contextmanager
def sigterm_deferred() -> Iterator[None]:
    """A block that a SIGTERM does not cut short: one that comes meanwhile ends the process when the block is
    done. For work whose half is worse than none, such as writing a profile trace at shutdown (the launcher
    waits for it: launch.py, Launcher.shutdown)."""
    _SigtermDeferral.depth += 1
    try:
        yield
    finally:
        _SigtermDeferral.depth -= 1
    if not _SigtermDeferral.depth and _SigtermDeferral.pending:
        _SigtermDeferral.pending = False
        raise SystemExit(0)


_exit_hooks: list[Callable[[], None]] = []


def at_child_exit(hook: Callable[[], None]) -> None:
    """Run `hook` when the child ends through exit_child (interpreter teardown and atexit are skipped there)."""
    _exit_hooks.append(hook)


def exit_child() -> NoReturn:
    """End a child that stopped normally (its loop returned, or SIGTERM) at once, with exit code 0, after its
    own cleanup and its at_child_exit hooks ran. Skipping the interpreter's teardown is deliberate: with a
    control thread still blocked on a ZeroMQ socket, that teardown could hang until the launcher's SIGKILL."""
    for hook in _exit_hooks:
        try:
            hook()
        except Exception:  # one failing hook must not keep the others, or the exit, from running
            logging.getLogger(__name__).exception("an exit hook failed")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def announce_ready(run_dir: str, role: str, worker: WorkerReady | None = None) -> None:
    """Tell the launcher this process is ready (model loaded, sockets bound): a ProcessReady, or a GPU worker's
    WorkerReady in its place (what it allocated and the limits it decided)."""
    import zmq

    from common.messages import ProcessReady
    from common.transport import Endpoints, push_socket, send

    sock = push_socket(zmq.Context.instance(), Endpoints(run_dir).launcher_ready)
    send(sock, worker if worker is not None else ProcessReady(role, os.getpid()))
    sock.close(linger=5000)  # our sockets drop unsent messages on close by default; this one must arrive
