"""A sandbox's own network: user-mode networking behind an egress filter.

Every sandbox lives in a network namespace of its own. ``disabled`` and
``restricted`` keep only its loopback. ``enabled`` gets a tap device served
by ``slirp4netns`` (user-mode TCP/IP: the sandbox's connections become
ordinary sockets of the slirp process on the host, so no bridge, route or
NAT rule is shared with anything), and before the tap exists an nftables
filter inside the namespace rejects every destination that is not the
public internet: the host's loopback and its own addresses, private,
shared, link-local (cloud metadata at 169.254.169.254), multicast and
reserved ranges, IPv4 and IPv6. ``allow_cidrs`` (``BERTH_SANDBOX_ALLOW_CIDRS``)
punches listed holes, evaluated first. slirp4netns runs with
``--disable-host-loopback`` too, so its gateway address never maps to the
host's 127.0.0.1 even if the filter were gone.

The filter lives in a namespace that the sandbox's processes cannot change:
they hold no capability (bubblewrap drops them, Docker is told to), and a
user namespace they might create owns only namespaces of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NetworkSetupError",
    "BLOCKED_V4",
    "BLOCKED_V6",
    "SLIRP_DNS",
    "host_addresses",
    "filter_ruleset",
    "apply_filter",
    "start_user_network",
    "UserNetwork",
    "process_start_time",
    "parse_cidrs",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# slirp4netns's fixed addresses: the sandbox is 10.0.2.100, its DNS forwarder
# 10.0.2.3 (answered by slirp from the host's resolvers).
SLIRP_DNS = "10.0.2.3"
_TAP = "tap0"
_MTU = 65520
_READY_TIMEOUT_S = 10.0

BLOCKED_V4: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
)
BLOCKED_V6: tuple[str, ...] = (
    "::/127",
    "::ffff:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "100::/64",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
)


class NetworkSetupError(Exception):
    """The sandbox's network could not be set up as its policy demands."""


def parse_cidrs(entries: Iterable[str]) -> list[Network]:
    """``BERTH_SANDBOX_ALLOW_CIDRS`` entries as networks; a bad entry raises ValueError."""
    return [ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip()]


def host_addresses() -> list[str]:
    """Every address of this host's interfaces (the sandbox must reach none
    of them: services bound to 0.0.0.0 answer on each)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, check=True, timeout=5).stdout
        interfaces = json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise NetworkSetupError(f"cannot list the host's addresses with `ip -j addr` (iproute2): {exc}") from exc
    found: list[str] = []
    for interface in interfaces:
        for info in interface.get("addr_info", ()):
            local = info.get("local")
            if isinstance(local, str):
                found.append(local.split("%")[0])
    return found


def filter_ruleset(allow: Sequence[Network], host: Sequence[str]) -> str:
    """The nftables ruleset of an ``enabled`` sandbox's namespace."""
    v4_allow = [str(n) for n in allow if n.version == 4]
    v6_allow = [str(n) for n in allow if n.version == 6]
    v4_block = list(BLOCKED_V4) + [f"{a}/32" for a in host if ipaddress.ip_address(a).version == 4]
    v6_block = list(BLOCKED_V6) + [f"{a}/128" for a in host if ipaddress.ip_address(a).version == 6]

    def element_set(name: str, kind: str, members: list[str]) -> str:
        body = f"elements = {{ {', '.join(members)} }}" if members else ""
        return f"  set {name} {{ type {kind}; flags interval; auto-merge; {body} }}\n"

    return (
        "table inet berth {\n"
        + element_set("allow4", "ipv4_addr", v4_allow)
        + element_set("allow6", "ipv6_addr", v6_allow)
        + element_set("block4", "ipv4_addr", v4_block)
        + element_set("block6", "ipv6_addr", v6_block)
        + "  chain output {\n"
        "    type filter hook output priority 0; policy accept;\n"
        '    oifname "lo" accept\n'
        f"    ip daddr {SLIRP_DNS} meta l4proto {{ tcp, udp }} th dport 53 accept\n"
        "    ip daddr @allow4 accept\n"
        "    ip6 daddr @allow6 accept\n"
        "    ip daddr @block4 meta l4proto tcp reject with tcp reset\n"
        "    ip daddr @block4 reject with icmp type admin-prohibited\n"
        "    ip6 daddr @block6 meta l4proto tcp reject with tcp reset\n"
        "    ip6 daddr @block6 reject with icmpv6 type admin-prohibited\n"
        "  }\n"
        "}\n"
    )


async def _run(argv: Sequence[str], stdin: bytes | None = None) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    out, _ = await asyncio.wait_for(proc.communicate(stdin), timeout=_READY_TIMEOUT_S)
    if proc.returncode != 0:
        raise NetworkSetupError(f"{argv[0]} failed ({proc.returncode}): {out.decode(errors='replace').strip()}")


async def apply_filter(netns: Path, ruleset: str) -> None:
    """Loads ``ruleset`` into the network namespace at ``netns``."""
    if shutil.which("nsenter") is None or shutil.which("nft") is None:
        raise NetworkSetupError("nsenter (util-linux) and nft (nftables) are needed to filter a sandbox's network")
    await _run(["nsenter", f"--net={netns}", "nft", "-f", "-"], stdin=ruleset.encode())


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks
    since boot); None when there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class UserNetwork:
    """The slirp4netns process serving an ``enabled`` sandbox. With its
    start time the pid names that one process, never a later one that
    reuses the pid."""

    pid: int
    start_time: int

    def to_private(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_private(cls, raw: object) -> UserNetwork | None:
        if not isinstance(raw, dict):
            return None
        try:
            return cls(pid=int(raw["pid"]), start_time=int(raw["start_time"]))
        except (KeyError, TypeError, ValueError):
            return None

    def stop(self) -> None:
        """Kills the process, only while its start time still matches, and
        reaps it when it is this process's child."""
        if process_start_time(self.pid) != self.start_time:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


async def start_user_network(netns: Path, log_path: Path) -> UserNetwork:
    """Starts slirp4netns for the namespace at ``netns`` and returns its
    process once the tap device is configured. It runs in its own session, so it
    outlives a restart of the Sandbox service as the sandbox does, and ends
    when the namespace goes."""
    binary = shutil.which("slirp4netns")
    if binary is None:
        raise NetworkSetupError("slirp4netns is not installed (apt-get install slirp4netns)")
    read_end, write_end = os.pipe()
    try:
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                [
                    binary,
                    "--configure",
                    f"--mtu={_MTU}",
                    "--disable-host-loopback",
                    "--enable-sandbox",
                    "--enable-seccomp",
                    f"--ready-fd={write_end}",
                    "--netns-type=path",
                    str(netns),
                    _TAP,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
                start_new_session=True,
                close_fds=True,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        os.close(write_end)
        write_end = -1
        loop = asyncio.get_running_loop()
        ready = await asyncio.wait_for(loop.run_in_executor(None, os.read, read_end, 1), timeout=_READY_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        raise NetworkSetupError(f"slirp4netns did not start: {exc!r}") from exc
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    if ready != b"1":
        popen.kill()
        popen.wait()
        tail = log_path.read_bytes()[-500:].decode(errors="replace").strip() if log_path.exists() else ""
        raise NetworkSetupError(f"slirp4netns failed to configure the sandbox's network: {tail}")
    return UserNetwork(pid=popen.pid, start_time=process_start_time(popen.pid) or 0)
