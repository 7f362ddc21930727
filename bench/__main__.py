"""Runs every benchmark and prints one table of p50/p95 and ratios to a
baseline measured in the same run.

    python -m bench              # all
    python -m bench gateway exec # a selection
    python -m bench faults       # optional: each service killed under load (PostgreSQL)
    python -m bench sandboxes    # optional: density of local sandboxes (creates 200)
    python -m bench scale        # optional: berth serve under 1-200 concurrent sessions, and the scale figures
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import tempfile
from pathlib import Path

from bench.runner import Result, print_table
from services.core.logging import configure_logging

BENCHMARKS = ["gateway", "exec", "environment", "turn", "harness", "docker", "replicas", "webhooks", "automations"]
# Run only when named.
OPTIONAL = ["faults", "sandboxes", "scale"]


async def _main(names: list[str]) -> None:
    results: list[Result] = []
    for name in names:
        module = importlib.import_module(f"bench.bench_{name}")
        # A sandbox that failed half-way may leave a busy mount: the table still prints.
        with tempfile.TemporaryDirectory(prefix=f"berth-bench-{name}-", ignore_cleanup_errors=True) as tmp:
            try:
                results.extend(await module.run(Path(tmp)))
            except Exception as exc:  # one broken benchmark must not hide the others
                print(f"benchmark {name} failed: {type(exc).__name__}: {exc}")
    print_table(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", default=BENCHMARKS, choices=BENCHMARKS + OPTIONAL, metavar="name")
    args = parser.parse_args()
    configure_logging("ERROR")
    asyncio.run(_main(args.names or BENCHMARKS))


if __name__ == "__main__":
    main()
