"""Run by tests/test_warm_cli.py through the suite's CLI runner: a run that never ends by itself and holds what a
multi-rank run holds (a forked rank that ignores SIGTERM, as one stuck in native code does, and multiprocessing's
resource tracker, which ignores it by design). It writes their pids to argv[1] once they exist."""

import json
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing import resource_tracker


def _rank() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)


if __name__ == "__main__":
    resource_tracker.ensure_running()
    rank = multiprocessing.get_context("fork").Process(target=_rank)
    rank.start()
    pids = {"run": os.getpid(), "rank": rank.pid, "tracker": resource_tracker._resource_tracker._pid}
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
