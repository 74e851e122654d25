"""``python -m weight_sync_bench`` and the ``wsb`` console script.

``wsb --version`` is answered from the installed distributions' metadata, and ``wsb [SUB]
--help`` from the kept help texts (``help``), both without importing torch; everything
else imports the command line (``cli.main``) and runs it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        from weight_sync_bench.version import version

        print(version())
        return 0
    from weight_sync_bench.help import answer

    text = answer(list(sys.argv[1:] if argv is None else argv))
    if text is not None:
        print(text, end="")
        return 0
    from weight_sync_bench.cli.main import main as run

    return run(argv, own_process=True)


if __name__ == "__main__":
    sys.exit(main())
