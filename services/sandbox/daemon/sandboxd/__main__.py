"""The command line: ``python3 sandboxd.pyz --socket ... --state-dir ...``.

A dormant daemon (``dormant``) runs this module too, and must import nothing
it does not need, so the full daemon's modules load only past this check.
"""

from __future__ import annotations

import sys

from .dormant import DORMANT_FLAG, START_DORMANT_FLAG, start, wait


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [DORMANT_FLAG]:
        wait(args)
    if START_DORMANT_FLAG in args:
        start(args)
    # The daemon speaks TLS to nothing, and OpenSSL's start-up would cost
    # every sandbox about 1 MiB (asyncio only imports ssl if it can).
    sys.modules["ssl"] = None  # type: ignore[assignment]
    from .cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
