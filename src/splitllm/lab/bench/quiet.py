"""How much CPU the rest of a shared machine takes while a benchmark measures (Linux /proc).

Timings on a shared machine are only worth comparing when nobody else was busy: `OtherLoad` wraps
a measurement and reports the cores other processes used meanwhile (all CPU time minus that of
the benchmark's own processes), and `wait_quiet` holds the next measurement until the machine
calms down.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK")


def _busy_ticks() -> int:
    """CPU ticks spent not idle, over all cores, since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle


def _process_ticks(pid: int) -> int:
    """User + system ticks of one process (all its threads)."""
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(after_name[11]) + int(after_name[12])  # fields 14 and 15: utime, stime


class OtherLoad:
    """Context manager: `cores` = mean cores used by processes other than `pids` while inside."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.cores = 0.0

    def _ours(self) -> int:
        return sum(_process_ticks(p) for p in self.pids)

    def __enter__(self) -> OtherLoad:
        self._t, self._busy, self._own = time.monotonic(), _busy_ticks(), self._ours()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = time.monotonic() - self._t
        others = (_busy_ticks() - self._busy) - (self._ours() - self._own)
        self.cores = max(others, 0) / _HZ / seconds if seconds > 0 else 0.0


def wait_quiet(pids: list[int], max_cores: float, window_s: float = 1.0, timeout_s: float = 600.0) -> float:
    """Wait until others use under `max_cores` over a window (or the timeout passes); their last load."""
    deadline = time.monotonic() + timeout_s
    while True:
        with OtherLoad(pids) as load:
            time.sleep(window_s)
        if load.cores < max_cores or time.monotonic() > deadline:
            return load.cores
