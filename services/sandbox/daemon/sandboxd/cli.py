"""The full daemon's command line: ``python3 sandboxd.pyz --socket ... --state-dir ...``
(``__main__`` hands it every command line but a dormant one)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
from typing import Dict, List, Optional

from .dormant import DORMANT_AFTER_FLAG, RESUME_FLAG, START_DORMANT_FLAG
from .processes import DEFAULT_RING_BYTES, PIPE_READ_SIZE
from .server import Daemon
from .workspace import VIRTUAL_ROOT


def _parse_args(argv: List[str]) -> argparse.Namespace:
    # A fixed help width: argparse otherwise asks shutil for the terminal's,
    # and importing shutil (with zlib, bz2 and lzma) costs every start and
    # every wake of a dormant daemon about 2 ms.
    formatter = functools.partial(argparse.HelpFormatter, width=100)
    parser = argparse.ArgumentParser(prog="sandboxd", description="Berth in-sandbox daemon", formatter_class=formatter)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--workspace", default=VIRTUAL_ROOT)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--isolation", default="unknown")
    parser.add_argument("--env-file", help="JSON object of extra environment for every command")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--ring-bytes", type=int, default=DEFAULT_RING_BYTES)
    parser.add_argument(
        DORMANT_AFTER_FLAG, type=float, default=0.0, metavar="SECONDS", help="go dormant after this long idle (0: never)"
    )
    parser.add_argument(START_DORMANT_FLAG, action="store_true", help="start dormant: bind the socket, load the rest on the first connection")
    parser.add_argument(RESUME_FLAG, help="the listening socket and open connections to adopt (set by dormancy)")
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


def run(argv: List[str]) -> int:
    args = _parse_args(argv)
    extra_env = _load_env(args.env_file, args.env)
    daemon = Daemon(
        socket_path=args.socket,
        workspace=args.workspace,
        state_dir=args.state_dir,
        isolation=args.isolation,
        extra_env=extra_env,
        ring_bytes=max(PIPE_READ_SIZE, args.ring_bytes),
        env_loader=functools.partial(_load_env, args.env_file, args.env),
        dormant_after_s=max(0.0, args.dormant_after),
        resume_fds=[int(fd) for fd in args.resume_fds.split(",")] if args.resume_fds else None,
    )
    asyncio.run(daemon.serve())
    return 0
