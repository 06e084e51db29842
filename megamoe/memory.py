"""Process memory readings (host RSS) that are not inherited from a parent process.

``ru_maxrss`` survives fork and exec on Linux, so a child started from a large process
reports the parent's peak; ``VmHWM`` belongs to the process's own address space.
"""
from __future__ import annotations

import resource


def _status_mib(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mib() -> float:
    """Current resident set size."""
    return _status_mib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mib() -> float:
    """Peak resident set size of this process (since exec, or since ``reset_peak``)."""
    return _status_mib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Restart the peak from the current RSS (Linux ``clear_refs``); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
