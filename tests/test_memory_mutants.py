"""``memory``: the process's and the machine's memory as the kernel files state it, parsed
from planted files, and each reading's fallback where the platform lacks it."""

from __future__ import annotations

import io
import resource
import subprocess
import sys

import pytest

from weight_sync_bench import memory

STATUS = ("Name:\tpython\nVmPeak:\t  999 kB\nVmHWM:\t    300 kB\nVmRSS:\t    200 kB\n"
          "VmSwap:\t 7 kB\n")
MEMINFO = "MemFree:   5 kB\nMemTotal:   24000 kB\nMemAvailable: 9 kB\n"


@pytest.fixture
def files(monkeypatch):
    """``memory``'s ``open`` reading planted contents by path; a path not planted is
    missing; ``written`` collects what was written and where."""
    planted: dict[str, str] = {}
    written: list[tuple[str, str, str]] = []

    def fake_open(path, mode="r"):
        if "w" in mode:
            buffer = io.StringIO()
            buffer.close = lambda: written.append((path, mode, buffer.getvalue()))
            return buffer
        if path not in planted:
            raise FileNotFoundError(path)
        return io.StringIO(planted[path])

    monkeypatch.setattr(memory, "open", fake_open, raising=False)
    return planted, written


def test_rss_reads_vmrss_and_vmhwm_in_bytes(files):
    planted, _ = files
    planted["/proc/self/status"] = STATUS
    assert memory.rss() == (200 * 1024, 300 * 1024)


def test_rss_is_none_without_proc(files):
    assert memory.rss() is None


def test_total_reads_memtotal_in_bytes_and_none_where_it_is_not_there(files):
    planted, _ = files
    planted["/proc/meminfo"] = MEMINFO
    assert memory.total() == 24000 * 1024
    planted["/proc/meminfo"] = "MemFree: 5 kB\n"  # no MemTotal line
    assert memory.total() is None
    planted["/proc/meminfo"] = "MemTotal:\n"  # a line without its number
    assert memory.total() is None
    planted["/proc/meminfo"] = "MemTotal: lots kB\n"
    assert memory.total() is None
    del planted["/proc/meminfo"]
    assert memory.total() is None


def test_resident_is_statms_second_field_in_pages(files, monkeypatch):
    planted, _ = files
    planted["/proc/self/statm"] = "1000 37 12 1 0 50 0\n"
    monkeypatch.setattr(memory.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096}[name])
    assert memory.resident() == 37 * 4096


def test_reset_peak_writes_5_to_clear_refs_and_says_whether_it_could(files, monkeypatch):
    _, written = files
    assert memory.reset_peak() is True
    assert written == [("/proc/self/clear_refs", "w", "5")]

    def refused(path, mode="r"):
        raise PermissionError(path)

    monkeypatch.setattr(memory, "open", refused, raising=False)
    assert memory.reset_peak() is False


def test_trim_is_false_where_glibc_is_not_there(monkeypatch):
    monkeypatch.setattr(memory, "_libc", None)

    def missing(name):
        assert name == "libc.so.6"
        raise OSError(name)

    monkeypatch.setattr(memory.ctypes, "CDLL", missing)
    assert memory.trim() is False

    class NoTrim:  # a libc without malloc_trim (musl)
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: NoTrim())
    assert memory.trim() is False


def test_trim_calls_malloc_trim_0_once_loaded(monkeypatch):
    calls = []
    loads = []

    class Libc:
        def malloc_trim(self, pad):
            calls.append(pad)

    monkeypatch.setattr(memory, "_libc", None)
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: loads.append(name) or Libc())
    assert memory.trim() is True and memory.trim() is True
    assert calls == [0, 0] and loads == ["libc.so.6"]  # loaded once, kept


def test_a_peak_reads_vmhwm_after_a_reset_else_the_lifetime_peak(files, monkeypatch):
    planted, _ = files
    planted["/proc/self/status"] = STATUS
    planted["/proc/self/statm"] = "1000 37 12 1 0 50 0\n"
    monkeypatch.setattr(memory, "trim", lambda: True)
    peak = memory.Peak()
    assert peak.reset is True and peak.began == 37 * memory.os.sysconf("SC_PAGE_SIZE")
    assert peak.high() == 300 * 1024
    asked = []
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: asked.append(who) or type(
        "Usage", (), {"ru_maxrss": 7000})())  # kB, as Linux states it
    del planted["/proc/self/status"]  # reset, but no status to read: the lifetime peak
    assert peak.high() == 7000 * 1024 and asked == [resource.RUSAGE_SELF]
    monkeypatch.setattr(memory, "reset_peak", lambda: False)
    planted["/proc/self/status"] = STATUS
    unreset = memory.Peak()
    assert unreset.reset is False and unreset.high() == 7000 * 1024  # not VmHWM's 300 kB


def test_keep_freed_sets_both_thresholds_and_says_whether_glibc_took_them(monkeypatch):
    calls = []

    class Libc:
        def __init__(self, answer: int):
            self.answer = answer

        def mallopt(self, option, value):
            calls.append((option, value))
            return self.answer

    monkeypatch.setattr(memory, "_libc", Libc(1))
    assert memory.keep_freed() is True
    assert calls == [(-3, 1 << 30), (-1, 1 << 30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    monkeypatch.setattr(memory, "_libc", Libc(0))  # glibc refused a value
    assert memory.keep_freed() is False
    monkeypatch.setattr(memory, "_libc", None)
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    assert memory.keep_freed() is False


FAULTS = """
import ctypes, resource, sys
from weight_sync_bench import memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert memory.keep_freed()
def faults(n=64 << 20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(n)
    ctypes.memset(block, 1, n)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(max(faults() for _ in range(3)))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_kept_memory_is_reused_where_glibc_hands_it_back_at_every_free():
    """64 MiB freed and asked for again: glibc's default maps and unmaps it each time
    (16,384 fresh pages, one fault each); kept, the second takes the same pages."""
    faults = {how: int(subprocess.run([sys.executable, "-c", FAULTS, how], check=True,
                                      capture_output=True, text=True).stdout)
              for how in ("keep", "default")}
    assert faults["default"] >= 16_000  # the twin: the cost it removes is there
    assert faults["keep"] < 100, faults
