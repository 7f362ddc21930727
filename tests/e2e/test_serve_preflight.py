"""`berth serve` checks the isolation of local sandboxes before it listens,
and `berth status` lists what is in force (issue 11, items 5 and 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BERTH = Path(sys.executable).parent / "berth"


def test_serve_without_isolation_tools_prints_the_install_command_and_exits_before_listening(tmp_path: Path) -> None:
    # A PATH with a shell only: no bubblewrap, slirp4netns, nft ... and no apt-get to install them.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sh").symlink_to("/bin/sh")
    data_dir = tmp_path / "data"
    env = {"PATH": str(bin_dir), "BERTH_DATA_DIR": str(data_dir), "BERTH_GATEWAY_PORT": "0", "HOME": str(tmp_path)}

    result = subprocess.run([str(BERTH), "serve"], env=env, capture_output=True, text=True, timeout=60)

    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "apt-get install -y" in result.stderr and "bubblewrap" in result.stderr and "slirp4netns" in result.stderr
    assert not data_dir.exists()


def test_status_lists_each_piece_of_isolation_in_force(tmp_path: Path, bwrap_available: None) -> None:
    env = {**os.environ, "BERTH_DATA_DIR": str(tmp_path / "data")}

    result = subprocess.run([str(BERTH), "status"], env=env, capture_output=True, text=True, timeout=60)

    pieces = {line.split()[0] + " " + line.split()[1] for line in result.stdout.splitlines() if line.startswith("  ")}
    states = [line.split(":")[0].split()[-1] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert {"user namespace", "network namespace", "disk quota"} <= pieces, result.stdout
    assert any(line.startswith("  limits") for line in result.stdout.splitlines())
    assert any(line.startswith("  seccomp") for line in result.stdout.splitlines())
    assert states and set(states) == {"on"}, result.stdout
