"""What the tests of ``wsb floor``'s own code share (``test_floor_measure_mutants.py``,
``test_floor_samples_mutants.py``): the command's arguments as its parser gives them, and a
progress line that keeps what it was shown."""

from __future__ import annotations

import argparse

from weight_sync_bench.cli import floor as F


def parse(*argv: str) -> argparse.Namespace:
    """``wsb floor ARGV``'s arguments, defaults included."""
    parser = argparse.ArgumentParser(prog="wsb")
    F.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["floor", *argv])


class Line:
    """A progress line that keeps what it was shown and how often it was closed."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.shown, self.closed = enabled, [], 0

    def show(self, text: str) -> None:
        self.shown.append(text)

    def close(self) -> None:
        self.closed += 1
