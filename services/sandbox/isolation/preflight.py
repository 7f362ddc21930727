"""What this host can enforce, checked before the Sandbox service listens
and printed by ``berth status``: one line per piece of isolation.

A local backend with isolation ``bwrap`` needs every piece; ``berth serve``
installs the missing Debian packages when it runs as root with apt
(``install_missing``), and otherwise prints the exact command and exits
before it listens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.isolation.cgroups import CgroupError, detect_cgroups
from services.sandbox.isolation.seccomp import DENIED_SYSCALLS

__all__ = ["Check", "check_local_host", "missing_packages", "can_install", "install_missing", "install_command", "TOOLS"]

# Each tool the local backend runs, and the Debian package that ships it.
TOOLS: dict[str, str] = {
    "bwrap": "bubblewrap",
    "slirp4netns": "slirp4netns",
    "nft": "nftables",
    "nsenter": "util-linux",
    "setpriv": "util-linux",
    "mkfs.ext4": "e2fsprogs",
    "ip": "iproute2",
}


@dataclass(frozen=True)
class Check:
    piece: str
    ok: bool
    detail: str


def _userns_works() -> str | None:
    """None when an unprivileged uid can make a user namespace, else why not."""
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        return "bwrap or setpriv is missing"
    try:
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bwrap", "--unshare-user", "--unshare-net",
             "--ro-bind", "/", "/", "true"],
            capture_output=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if result.returncode == 0 else result.stderr.decode(errors="replace").strip()


def _seccomp_loads() -> str | None:
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"libseccomp is not usable: {exc}"
    return None


def missing_packages() -> list[str]:
    return sorted({package for tool, package in TOOLS.items() if shutil.which(tool) is None})


def check_local_host() -> list[Check]:
    """Every piece of a confined local sandbox, each with what is in force or what is missing."""
    checks: list[Check] = []
    missing = missing_packages()
    checks.append(Check("tools", not missing, "installed" if not missing else f"missing packages: {' '.join(missing)}"))
    userns = _userns_works()
    checks.append(
        Check(
            "user namespace",
            userns is None,
            "own per sandbox: uid 1000 inside, a unique unprivileged host uid outside" if userns is None else userns,
        )
    )
    checks.append(
        Check(
            "network namespace",
            shutil.which("slirp4netns") is not None and shutil.which("nft") is not None,
            "own per sandbox; enabled: slirp4netns behind an nftables egress filter (no host, private or link-local "
            "address); disabled: loopback only; restricted: loopback plus the egress proxy",
        )
    )
    try:
        cgroups = detect_cgroups()
        swap = "memory with swap" if cgroups.swap_accounted else "memory (the host has no swap)"
        checks.append(Check("limits", True, f"cgroup {cgroups.version}: {swap}, pids, cpu, freezer"))
    except CgroupError as exc:
        checks.append(Check("limits", False, str(exc)))
    loop = Path("/dev/loop-control").exists()
    checks.append(
        Check(
            "disk quota",
            loop and shutil.which("mkfs.ext4") is not None,
            "ext4 image per workspace, loop-mounted" if loop else "no loop devices (/dev/loop-control)",
        )
    )
    seccomp = _seccomp_loads()
    checks.append(
        Check("seccomp", seccomp is None, f"{len(DENIED_SYSCALLS)} syscalls and namespace clones denied" if seccomp is None else seccomp)
    )
    return checks


def install_command(packages: list[str]) -> str:
    return f"apt-get update && apt-get install -y {' '.join(packages)}"


def can_install() -> bool:
    """Whether this process can install packages: root, with apt."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def install_missing() -> bool:
    """Installs the missing packages with apt when this process is root and
    apt exists; False when it cannot (then nothing was tried)."""
    packages = missing_packages()
    if not packages:
        return True
    if not can_install():
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *packages], check=False, env=env)
    return not missing_packages()
