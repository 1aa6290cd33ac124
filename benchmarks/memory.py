"""Process memory figures for the benchmarks (Linux ``/proc``): the RSS high-water mark and its reset.

Imported by the ``bench_*.py`` scripts of this folder (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import resource

__all__ = ["status_mb", "reset_peak"]


def status_mb(field: str) -> float:
    """``VmHWM`` (peak RSS) or ``VmRSS`` of this process in MB. ``/proc`` rather than ``ru_maxrss``, which Linux
    carries over from the parent across fork/exec (the fallback where ``/proc`` is missing)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` value 5); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
