"""Process and host memory figures from /proc and `resource` (psutil is not a dependency)."""

from __future__ import annotations

import os
import resource
import sys

_KIB = 1024


def _read_kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """Return the 'Name:  123 kB' fields of a /proc file in bytes; missing file or fields are left out."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in names:
                    found[key] = int(rest.split()[0]) * _KIB
    except OSError:
        pass
    return found


def _peak_rss_from_rusage() -> int:
    """Return the peak resident set size; ru_maxrss is KiB on Linux and bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * _KIB


def process_rss() -> int:
    """Return the resident set size of this process in bytes."""
    fields = _read_kib_fields("/proc/self/status", ("VmRSS",))
    return fields.get("VmRSS", _peak_rss_from_rusage())


def process_peak_rss() -> int:
    """Return the peak resident set size of this process in bytes (since the last reset where supported)."""
    fields = _read_kib_fields("/proc/self/status", ("VmHWM",))
    return fields.get("VmHWM", _peak_rss_from_rusage())


def reset_process_peak_rss() -> None:
    """Restart the peak RSS from the current RSS; a no-op where the kernel offers no reset."""
    # Writing "5" to clear_refs resets VmHWM (Linux >= 4.0); elsewhere the peak simply keeps growing.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def host_total_memory() -> int:
    """Return the host's physical memory in bytes."""
    fields = _read_kib_fields("/proc/meminfo", ("MemTotal",))
    if "MemTotal" in fields:
        return fields["MemTotal"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_available_memory() -> int:
    """Return the memory the host can still hand out without swapping, in bytes."""
    fields = _read_kib_fields("/proc/meminfo", ("MemAvailable", "MemFree"))
    if "MemAvailable" in fields:
        return fields["MemAvailable"]
    if "MemFree" in fields:
        return fields["MemFree"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
