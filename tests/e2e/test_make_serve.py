"""The README's first command works as printed: `make serve` starts every
service, prints a key and a curl example, and the curl example succeeds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_serve_prints_a_key_and_a_curl_example_that_works(tmp_path: Path, bwrap_available: None) -> None:
    env = {
        **os.environ,
        "BERTH_DATA_DIR": str(tmp_path / "data"),
        "BERTH_GATEWAY_PORT": "0",
        "BERTH_SESSION_ADDR": "127.0.0.1:0",
        "BERTH_ENVIRONMENT_ADDR": "127.0.0.1:0",
        "BERTH_SANDBOX_ADDR": "127.0.0.1:0",
        "BERTH_LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "-d '" in line:
                break
        text = "".join(lines)
        match = re.search(r"(curl -s .*?-d '[^']*')", text, re.S)
        assert match, text
        key = re.search(r"sk-berth-[A-Za-z0-9_-]+", text)
        assert key, text
        curl = match.group(1).replace("\\\n", " ")
        result = subprocess.run(curl + " -o /dev/null -w '%{http_code}'", shell=True, capture_output=True, text=True, timeout=60)
        assert result.stdout == "201", (result.stdout, result.stderr, text)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
