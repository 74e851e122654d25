"""What every subcommand shares: the exit codes, the options ``-q``, ``--json`` and
``--deadline``, a progress line, JSON records, and the guard that keeps measuring commands
from silently replacing a committed artifact.

The exit codes are one contract for every subcommand (``EXIT_CODES``, printed by ``wsb
--help``); ``main.exit_code`` maps exceptions to them.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from weight_sync_bench.cli.records import keys_of
from weight_sync_bench.errors import ArtifactProtected, InvalidNumber
from weight_sync_bench.model.footprint import DEFAULT_MAX_FLOPS, GIB, Limits

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_HARNESS = 3
EXIT_USER_CODE = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away (`wsb check | head`)

EXIT_CODES = """\
exit status (the same for every subcommand):
    0    every check passed
    1    a check failed: a counterexample (a failed verdict, a mutant not killed, a corpus
         entry whose claim no longer holds)
    2    bad input or usage: argparse's errors, a typed error about the input (a bad
         number, an unsupported degree, a malformed --hf-config file, a geometry over
         --max-gib / --max-gflop or more rank processes than the cap, a corrupt or
         oversized corpus file, a tolerance artifact that does not cover the check, an
         artifact --write/--force protects), a
         MODULE:FUNCTION that does not exist (no module of that name importable from here,
         or no function of that name in it), or a run that checked nothing
    3    a harness fault: a rank crashed, stopped or timed out (RankFailure), the committed
         artifacts cannot be found (MissingArtifacts), or a bug of the harness itself
    4    your code failed: a --resharder / --splitter / --converter (or the function given
         to check_split / check_reshard / check_convert) raised, raised while its module was
         imported, has a signature the harness cannot call, or returned something that is
         not shards of the layout
    130  interrupted (Ctrl-C), after the partial summary; 143 terminated (SIGTERM)
    when several apply: 1 before 3 before 2 (a counterexample is a result whatever else
    happened)"""

ENVIRONMENT = """\
environment:
    WSB_TOLERANCE_DIR  the measured floors (tolerance/*.json) thresholds are read from
    WSB_CORPUS_DIR     saved counterexamples (corpus/*.json), read and written by fuzz, replay
                       (your own function's: default wsb-corpus/ in the current directory)
    WSB_FUZZ_DIR       the fuzz runner's example database and summaries (default
                       .hypothesis/ in the current directory)
    WSB_PROFILE        the Hypothesis profile when --profile is not given (default wsb-test)
    WSB_MAX_RANKS      the most rank processes a gloo pool starts (default max(2 x CPUs, 16))
    the others default to the checkout the package was imported from"""

# Progress on a terminal is rewritten in place at most this often; into a file or a pipe
# (CI logs) one line is printed at most this often, plus the first and the last.
LIVE_PERIOD = 0.1
LOG_PERIOD = 10.0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run ends like an interrupted one: its
    partial summary printed, its rank processes and temporary directories removed."""


def interrupt_code(exc: BaseException) -> int:
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


_pending: list[KeyboardInterrupt] = []  # interrupts signalled during this run, in order


def pending_interrupt() -> KeyboardInterrupt | None:
    """The interrupt signalled during this run, if any. A ``KeyboardInterrupt`` raised while
    a garbage-collector callback runs (Hypothesis installs one) is swallowed by Python, so a
    loop that must stop checks this between its steps rather than trust the raise alone."""
    return _pending[0] if _pending else None


@contextmanager
def signals_raise() -> Iterator[None]:
    """While inside (main thread only; elsewhere a no-op): SIGINT raises ``KeyboardInterrupt``
    and SIGTERM ``Terminated``, each also recorded for ``pending_interrupt``."""
    def on_signal(signum: int, frame: object) -> None:
        exc = Terminated("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt()
        _pending.append(exc)
        raise exc

    try:
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread
        yield
        return
    _pending.clear()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _pending.clear()


# -- argument types and options


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def count(text: str) -> int:
    """An argparse type: an int >= 1 (a budget of 0 would "pass" having done nothing)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def rank(text: str) -> int:
    """An argparse type: a rank, an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a rank is >= 0, got {text}")
    return value


def positive(text: str) -> float:
    """An argparse type: a finite number > 0 (not NaN, not inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}")
    return value


def seed(text: str) -> int:
    """An argparse type: an int in 0..2^63-1."""
    try:
        return InvalidNumber.seed("seed", int(text))
    except (ValueError, InvalidNumber):
        raise argparse.ArgumentTypeError(f"must be an int in 0..2^63-1, got {text}") from None


def add_output_options(parser: argparse.ArgumentParser, *, json_records: bool = True) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress line; print failures and the closing line only")
    if json_records:
        parser.add_argument("--json", action="store_true",
                            help="one JSON object per line on stdout, one per check, then a "
                                 "summary (see the README's 'Exit codes and machine-readable "
                                 "output')")
        parser.add_argument("--strict-env", action="store_true",
                            help="refuse a floor measured under another torch, numpy, Python, "
                                 "machine class or CPU kernel set than this one (exit 2), "
                                 "rather than note it (the same as WSB_STRICT_ENV=1)")


def add_limit_options(parser: argparse.ArgumentParser, *, max_gib: float | None = None,
                      max_gflop: float = DEFAULT_MAX_FLOPS / 1e9, what: str = "a check") -> None:
    """``--max-gib G`` and ``--max-gflop F``: the most ``what`` may cost
    (``model.footprint``), refused before anything is allocated. ``max_gib`` None: this
    machine's memory (``Limits()``)."""
    memory = (f"{max_gib:g}" if max_gib is not None else
              "this machine's memory, /proc/meminfo MemTotal")
    parser.add_argument("--max-gib", type=positive, default=max_gib, metavar="G",
                        help=f"refuse {what} whose estimated memory exceeds G GiB (default "
                             f"{memory})")
    parser.add_argument("--max-gflop", type=positive, default=max_gflop, metavar="F",
                        help=f"refuse {what} whose estimated work exceeds F GFLOP (default "
                             f"{max_gflop:g})")


def limits_of(args: argparse.Namespace) -> Limits:
    """The ``Limits`` that ``--max-gib`` and ``--max-gflop`` give."""
    if args.max_gib is None:
        return Limits(max_flops=args.max_gflop * 1e9)
    return Limits(max_bytes=int(args.max_gib * GIB), max_flops=args.max_gflop * 1e9)


def add_deadline_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deadline", type=positive, default=None, metavar="SECONDS",
                        help="the most one call of your function (--converter, --resharder, "
                             "--splitter) may take, in process (default: unbounded; exit 4 "
                             "with its stack when over), and with gloo the rank pool's "
                             "watchdog deadline for one task (default 60; a rank that has "
                             "not finished by then is named)")


def apply_deadline(deadline: float | None, gloo: bool) -> None:
    """``--deadline``: bound each call of the user's function (``user_code.set_deadline``)
    and, on gloo runs, set the shared rank pool's watchdog deadline."""
    if deadline is None:
        return
    from weight_sync_bench.check.user_code import set_deadline

    set_deadline(deadline)
    if gloo:
        from weight_sync_bench.collectives.gloo.pool import shared_pool  # the gloo launcher
        shared_pool(4, deadline=deadline)


# -- output


def _plain(value: Any) -> Any:
    """JSON has no NaN or inf: those become the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class Output:
    """Where a subcommand's results go: text tables, or one JSON object per line
    (``--json``); ``-q`` drops the progress line and the passing rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(getattr(args, "json", False))
        self.quiet = bool(getattr(args, "quiet", False))
        self.command = getattr(args, "command", None) or "wsb"

    def text(self, line: str = "") -> None:
        if not self.json:
            print(line, flush=True)

    def record(self, kind: str, **fields: Any) -> None:
        """One ``--json`` record; its keys are its kind's (``records.KEYS``), whether or not
        this run prints it."""
        keys = keys_of(kind, self.command)
        assert sorted(fields) == sorted(keys), (kind, sorted(set(fields) ^ set(keys)))
        if self.json:
            print(json.dumps(_plain({"kind": kind, **fields}), allow_nan=False), flush=True)

    def note(self, text: str) -> None:
        """A note on how a result was judged (``note: ...`` in text, a ``note`` record in JSON)."""
        self.text(f"note: {text}")
        self.record("note", text=text)

    def summary(self, exit_code: int, **fields: Any) -> None:
        self.record("summary", command=self.command, exit_code=exit_code, **fields)

    def progress(self) -> ProgressLine:
        return ProgressLine(enabled=not self.quiet)


class ProgressLine:
    """One progress line on stderr: rewritten in place on a terminal; elsewhere (a CI log)
    the first line, then at most one every ``LOG_PERIOD`` seconds, then the last."""

    def __init__(self, *, enabled: bool = True, period: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.live = sys.stderr.isatty()
        self.period = period if period is not None else (LIVE_PERIOD if self.live else LOG_PERIOD)
        self.clock = clock
        self.width = 0
        self.last: float | None = None
        self.pending: str | None = None  # the newest line not yet shown

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self.last is not None and now - self.last < self.period:
            self.pending = text
            return
        self._emit(text)
        self.last, self.pending = now, None

    def _emit(self, text: str) -> None:
        if self.live:
            print("\r" + text.ljust(self.width), end="", file=sys.stderr, flush=True)
            self.width = len(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.pending is not None:
            self._emit(self.pending)
            self.pending = None
        if self.live and self.width:
            print(file=sys.stderr)
            self.width = 0


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Ticker:
    """A measuring loop's ``progress(done, total, what)`` on a ``ProgressLine``: what it is
    at, ``done/total``, the time elapsed since the ticker was made and an ETA (the elapsed
    time per unit done, times the units left; ``?`` before the first)."""

    def __init__(self, line: ProgressLine, prefix: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.line, self.prefix, self.clock = line, prefix, clock
        self.start = clock()

    def __call__(self, done: int, total: int, what: str) -> None:
        elapsed = self.clock() - self.start
        eta = duration(elapsed / done * (total - done)) if done > 0 else "?"
        self.line.show(f"{self.prefix}{what}: {done}/{total}, {duration(elapsed)} elapsed, "
                       f"ETA {eta}")


# -- measuring commands never silently replace a committed artifact


def side_by_side(rows: Sequence[tuple[str, str, str]], old: str, new: str) -> str:
    """A three-column table: figure, the old artifact's value, the new one's."""
    table = [("", old, new), *rows]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def guard_target(target: Path, *, named: bool, write: bool, command: str) -> dict[str, Any] | None:
    """Before measuring: refuse to replace the committed artifact ``target`` unless
    ``--write`` (``named``: the user gave ``--out``). Returns the artifact there now, if
    one is there and readable, for the side-by-side figures and the sample-size check."""
    if not named and not write:
        raise ArtifactProtected(
            f"{command}: would replace the committed {target}: pass --write to replace it, "
            "or --out PATH to write the measurement elsewhere")
    try:
        old = json.loads(target.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # unreadable: nothing to compare, and nothing worth keeping
    return old if isinstance(old, dict) else None


def refuse_smaller(target: Path, *, old: int, new: int, what: str, force: bool) -> None:
    """Refuse to replace a measurement of ``old`` ``what`` with one of fewer (``--force``)."""
    if new < old and not force:
        raise ArtifactProtected(
            f"{target} holds {old} {what}; this measurement would have {new}: pass --force "
            "to replace a larger measurement with a smaller one (or --out PATH)")
