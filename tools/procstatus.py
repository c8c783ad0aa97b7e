"""The memory counters of this process from ``/proc/self/status`` (Linux), in bytes, for the benchmarks."""

from __future__ import annotations

COUNTERS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def memory_status() -> dict[str, int]:
    """Resident set now (``VmRSS``), its high-water mark (``VmHWM``) and its anonymous, file and shared parts."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in COUNTERS:
                found[key] = int(value.split()[0]) * 1024
    return found
