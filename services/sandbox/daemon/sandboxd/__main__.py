"""The command line: ``python3 sandboxd.pyz --socket ... --state-dir ...``."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from typing import Dict, List, Optional

from .processes import DEFAULT_RING_BYTES, PIPE_READ_SIZE
from .server import Daemon
from .workspace import VIRTUAL_ROOT


def _parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sandboxd", description="Berth in-sandbox daemon")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--workspace", default=VIRTUAL_ROOT)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--isolation", default="unknown")
    parser.add_argument("--env-file", help="JSON object of extra environment for every command")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--ring-bytes", type=int, default=DEFAULT_RING_BYTES)
    return parser.parse_args(argv)


def _load_env(env_file: Optional[str], items: List[str]) -> Dict[str, str]:
    """The extra environment: the JSON object in ``env_file`` (if it
    exists), then the ``NAME=VALUE`` items."""
    env: Dict[str, str] = {}
    if env_file and os.path.exists(env_file):
        with open(env_file) as handle:
            loaded = json.load(handle)
        if not isinstance(loaded, dict):
            raise ValueError("%s does not hold a JSON object" % env_file)
        env.update({str(k): str(v) for k, v in loaded.items()})
    for item in items:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    extra_env = _load_env(args.env_file, args.env)
    daemon = Daemon(
        socket_path=args.socket,
        workspace=args.workspace,
        state_dir=args.state_dir,
        isolation=args.isolation,
        extra_env=extra_env,
        ring_bytes=max(PIPE_READ_SIZE, args.ring_bytes),
        env_loader=functools.partial(_load_env, args.env_file, args.env),
    )
    asyncio.run(daemon.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
