"""An engine process started by a client ends when that client ends, however it ends.

Two mechanisms, because neither covers every case alone: on Linux, `PR_SET_PDEATHSIG` asks the
kernel for a SIGTERM the moment the parent goes (it fires when the parent *thread* that started
the process exits, so it is only armed when that thread is the parent's main thread); and a
watch thread that sees the parent pid change (the process is re-parented when its parent dies,
SIGKILL included). A SIGTERM lets the engine stop cleanly; one that is stuck in a step is ended
a few seconds later. Knows nothing of engines.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger(__name__)

# How often the watch looks at the parent pid.
PARENT_POLL_S = 0.25
# How long a process whose parent is gone has to stop cleanly after SIGTERM.
PARENT_GONE_EXIT_S = 3.0
# prctl(2) option: the signal this process gets when the thread that started it exits.
_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Makes this process end when the process `parent_pid` is gone; returns at once.

    Args:
        parent_pid: the pid of the process that started this one.
        use_pdeathsig: also arm PR_SET_PDEATHSIG (Linux); only safe when the starting thread
            lives as long as its process (a main thread).
    """
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        except (OSError, AttributeError) as e:
            logger.debug("PR_SET_PDEATHSIG unavailable: %s", e)
    thread = threading.Thread(
        target=_watch_parent, args=(parent_pid,), name="ParentWatch", daemon=True
    )
    thread.start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    logger.warning("the process that started this engine (pid %d) is gone; stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(PARENT_GONE_EXIT_S)
    logging.shutdown()
    os._exit(1)
