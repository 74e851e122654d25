"""This process's memory (and the machine's), read from the kernel, and freed heap handed
back to it.

What the harness's memory figures are made of (a streamed check's peak per rank, a
resharder's extra memory per rank, the default limit of ``model.footprint``): Linux's
``/proc/self`` (``statm``, ``status``'s ``VmRSS`` and ``VmHWM``, ``clear_refs``),
``/proc/meminfo``'s ``MemTotal`` and glibc's ``malloc_trim`` and ``mallopt``. Each degrades
where the platform lacks it, and says so: ``trim``, ``keep_freed`` and ``reset_peak`` return
False, ``rss`` and ``total`` None, and a ``Peak`` that could not reset reads the process's
lifetime peak (``ru_maxrss``), which can only overstate. Imports no layer, so every layer
may use it.
"""

from __future__ import annotations

import ctypes
import os
import resource

_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL:
    """glibc, loaded once (``OSError`` where there is none)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL("libc.so.6")
    return _libc


def trim() -> bool:
    """Hand freed heap pages back to the kernel (glibc ``malloc_trim(0)``, which also
    releases whole free pages inside the heap, not only at its top). glibc keeps freed
    chunks under its mmap threshold (which grows up to 32 MiB as large blocks are freed)
    for reuse, so without this a process's resident set counts the shards of parameters
    long dropped. False where glibc is not this process's allocator."""
    try:
        _glibc().malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


# glibc's mallopt parameters (malloc.h) and what keep_freed sets both to
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT = 1 << 30


def keep_freed() -> bool:
    """Keep freed heap in this process for reuse instead of handing it back to the kernel:
    glibc ``mallopt`` with the trim and the mmap thresholds at 1 GiB (set, either stops
    glibc adjusting the other; both are set). By default glibc hands back the top of its
    heap past 64 MiB free, and every block over 32 MiB at its ``free``; a process that
    allocates and frees the same few hundred MB again and again then touches fresh pages
    each time, one fault per 4 KiB. A training check holds two runs' traces at once, more
    than either run alone: at TOY its faults cost 0.6-0.9x the reference's whole step
    (``bench/bench_training.py --glibc-default``). For a process that is the harness alone
    (``wsb train-check``); a caller's process is never changed by a library call. False
    where glibc is not this process's allocator (``trim``, ``malloc_trim(0)``, still hands
    back every free page when a memory figure is taken)."""
    try:
        kept = [_glibc().mallopt(option, KEPT) for option in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)]
    except (OSError, AttributeError):
        return False
    return all(kept)


def reset_peak() -> bool:
    """Reset this process's resident-set high-water mark (``VmHWM``: Linux resets it on
    writing 5 to ``/proc/self/clear_refs``). False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss() -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` of this process in bytes, or None where /proc has no status."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return None
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def total() -> int | None:
    """This machine's physical memory in bytes (``MemTotal`` of ``/proc/meminfo``), or None
    where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident() -> int:
    """The resident set now, in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """This process's resident-set high-water mark from now on: freed heap is handed back
    (``trim``) and ``VmHWM`` reset (``reset_peak``), so a pool rank that ran larger tasks
    before reports this one's peak. Where the reset is refused, the process's lifetime peak
    (``ru_maxrss``), which can only overstate it."""

    def __init__(self) -> None:
        trim()
        self.reset = reset_peak()
        self.began = resident()

    def high(self) -> int:
        if self.reset:
            now = rss()
            if now is not None:
                return now[1]
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
