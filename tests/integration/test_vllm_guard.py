"""vLLM's process group dies with its replica (`inference/vllm/process.py`'s guard), without vLLM:
a stand-in server whose own child outlives it, as vLLM's engine core and workers outlived a replica
killed -9 before the guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PARENT = r"""
import subprocess, sys, time
from burstrl.inference.vllm.process import GUARD, _usr1_on_parent_death
# the stand-in "server": starts a grandchild that ignores SIGTERM (a worker), prints the group, sleeps
server = [sys.executable, "-c", "import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
          "print(os.getpgid(0), flush=True); time.sleep(600)"]
proc = subprocess.Popen(["bash", "-c", GUARD, "vllm-guard", *server], stdout=subprocess.PIPE, text=True,
                        start_new_session=True, preexec_fn=_usr1_on_parent_death)
print(proc.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _group_alive(pgid: int) -> bool:
    """Any process of the group that is not a zombie."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_the_whole_group_dies_when_the_replica_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    pgid = int(parent.stdout.readline())
    try:
        assert _group_alive(pgid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(pgid)
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
