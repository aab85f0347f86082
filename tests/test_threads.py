"""Compute threads pinned a core each while they compute, and given their cores back (threads.pin_compute_threads).

Each check runs in a fresh Python process: pinning changes the threads of the process that asks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitllm.testing.launch import ServerProcess

CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="pinning needs a thread per core of at least two cores")

# Prints what each case saw: every thread's cores before, inside and after the pinned block, the
# calling thread's inside, what pin_compute_threads returned, and whether the math stayed right.
PROBE = """
import json, os, sys, torch
from splitllm.threads import compute_threads_pinned, pin_compute_threads

def cores():
    return sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task"))

torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(512, 512), torch.randn(512, 512)
want = a @ b  # the team exists before the block, as it does in a client that loaded its weights
before = cores()
with compute_threads_pinned():
    inside, caller = cores(), sorted(os.sched_getaffinity(0))
    same = bool(torch.equal(a @ b, want))
print(json.dumps({"before": before, "inside": inside, "after": cores(), "caller": caller, "same": same,
                  "returned": len(pin_compute_threads())}))
"""


def _probe(threads: int, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threads)], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})}, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_thread_per_core_is_pinned_one_to_a_core_and_given_its_cores_back() -> None:
    seen = _probe(len(CORES))
    singles = [c for c in seen["inside"] if len(c) == 1]
    assert sorted(singles) == [[c] for c in CORES], seen  # one thread of the team on each core
    assert seen["caller"] == [CORES[0]]  # the calling thread is thread 0 of its team
    assert seen["after"] == seen["before"] and all(c == CORES for c in seen["before"])
    assert seen["same"]
    assert seen["returned"] == len(CORES)  # the same team, pinned again outside the block


@pytest.mark.parametrize(
    ("threads", "env"), [(1, None), (len(CORES), {"OMP_PROC_BIND": "false"})], ids=["one thread", "OMP_PROC_BIND set"]
)
def test_fewer_threads_than_cores_or_openmps_own_binding_leave_threads_free(threads: int, env: dict | None) -> None:
    seen = _probe(threads, env)
    assert seen["inside"] == seen["before"] and seen["caller"] == CORES and seen["same"]
    assert seen["returned"] == 0


def _thread_cores(pid: int) -> dict[int, str]:
    """Cpus_allowed_list of every thread of a process, by thread id (the main thread's is the pid)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        found[int(task.name)] = next(
            line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
        )
    return found


def test_a_server_pins_its_compute_threads_and_leaves_its_event_loop_free(  # type: ignore[no-untyped-def]
    tiny_models
) -> None:
    args = ["--model", str(tiny_models["qwen2"]), "--first", "1", "--last", "1", "--threads", str(len(CORES))]
    with ServerProcess(*args, timeout=120) as server:
        pid = server.proc.pid  # type: ignore[union-attr]
        threads = _thread_cores(pid)
    assert sorted(t for t in threads.values() if t.isdigit()) == [str(c) for c in CORES], threads
    assert threads[pid] not in {str(c) for c in CORES}  # the event loop's thread may run on any core
