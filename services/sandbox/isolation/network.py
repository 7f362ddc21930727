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
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.sandbox.isolation.commands import TOOL_PATH, run_tool

__all__ = [
    "NetworkSetupError",
    "BLOCKED_V4",
    "BLOCKED_V6",
    "SLIRP_DNS",
    "host_addresses",
    "filter_ruleset",
    "apply_filter",
    "start_user_network",
    "prepare_user_network",
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


log = structlog.stdlib.get_logger(__name__)

# The slirp4netns processes this process started, until ``UserNetwork.stop``
# reaps them. A Popen dropped unwaited joins subprocess's list of children
# that every later Popen polls, one wait call each: with hundreds of
# sandboxes, each start paid for every running one.
_SLIRPS: dict[int, subprocess.Popen[bytes]] = {}


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


async def apply_filter(netns: Path, ruleset: str) -> None:
    """Loads ``ruleset`` into the network namespace at ``netns``."""
    if shutil.which("nsenter") is None or shutil.which("nft") is None:
        raise NetworkSetupError("nsenter (util-linux) and nft (nftables) are needed to filter a sandbox's network")
    await run_tool(
        ["nsenter", f"--net={netns}", "nft", "-f", "-"], error=NetworkSetupError, timeout_s=_READY_TIMEOUT_S, stdin=ruleset.encode()
    )


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
        popen = _SLIRPS.pop(self.pid, None)
        if popen is not None:
            popen.wait()
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


# Whether slirp4netns's own sandbox (a private mount namespace it pivots
# into) works on this host; it does not in some containers ("cannot
# pivot_root"). Found out once per process, on a throwaway namespace.
_slirp_sandbox_works: bool | None = None
_PROBE_LOCK = asyncio.Lock()


async def start_user_network(netns: Path, log_path: Path) -> UserNetwork:
    """Starts slirp4netns for the namespace at ``netns`` and returns its
    process once the tap device is configured. It runs in its own session, so
    it outlives a restart of the Sandbox service as the sandbox does; the
    backend stops it when it destroys the sandbox.

    slirp runs with ``--enable-seccomp`` always, and with ``--enable-sandbox``
    (its own mount namespace, capabilities dropped) wherever that works; where
    it cannot pivot its root, as in some containers, it runs without it and
    says so once in the log (``slirp_sandbox_unavailable``). Neither changes
    what the sandbox can reach: the egress filter is inside the sandbox's
    namespace."""
    binary = shutil.which("slirp4netns")
    if binary is None:
        raise NetworkSetupError("slirp4netns is not installed (apt-get install slirp4netns)")
    sandboxed = await _slirp_sandbox_usable(binary, log_path)
    return await _spawn_slirp(binary, netns, log_path, sandboxed=sandboxed)


async def prepare_user_network(log_dir: Path) -> None:
    """Finds out, ahead of the first ``enabled`` sandbox, how slirp4netns can
    run here (a fraction of a second, once per process)."""
    binary = shutil.which("slirp4netns")
    if binary is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        await _slirp_sandbox_usable(binary, log_dir / "slirp-probe.log")


async def _slirp_sandbox_usable(binary: str, log_path: Path) -> bool:
    global _slirp_sandbox_works
    async with _PROBE_LOCK:
        if _slirp_sandbox_works is None:
            _slirp_sandbox_works = await _probe_slirp_sandbox(binary, log_path)
            if not _slirp_sandbox_works:
                log.warning("slirp_sandbox_unavailable", detail="slirp4netns runs without --enable-sandbox on this host")
        return _slirp_sandbox_works


async def _probe_slirp_sandbox(binary: str, log_path: Path) -> bool:
    """Runs a sandboxed slirp4netns on a throwaway network namespace and
    reports whether it is still running shortly after it signalled ready."""
    if shutil.which("unshare") is None:
        return False
    holder = subprocess.Popen(
        ["unshare", "--net", "sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _READY_TIMEOUT_S
        netns = Path(f"/proc/{holder.pid}/ns/net")
        try:
            while os.readlink(netns) == os.readlink("/proc/self/ns/net"):
                if loop.time() > deadline or holder.poll() is not None:
                    return False
                await asyncio.sleep(0.005)
        except OSError:
            return False
        try:
            slirp = await _spawn_slirp(binary, netns, log_path.with_name("slirp-probe.log"), sandboxed=True)
        except NetworkSetupError:
            return False
        alive = not await loop.run_in_executor(None, _exited_within, slirp.pid, 0.3)
        slirp.stop()
        return alive
    finally:
        holder.kill()
        holder.wait()


def _exited_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return process_start_time(pid) is None
        if waited == pid:
            return True
        time.sleep(0.01)
    return False


def _private_mounts(sandboxed: bool) -> list[str]:
    """The prefix that runs a sandboxed slirp4netns in a mount namespace of
    its own whose mounts are all private. slirp's sandbox makes only ``/``
    private before it pivots and detaches the old root, so without this the
    detach propagates to the host's shared mounts: every namespace bind-mounted
    under ``/run/netns`` (``ip netns add``) was unmounted on the host each time
    an ``enabled`` sandbox started. ``unshare`` execs slirp4netns in place, so
    the pid stays slirp's."""
    if not sandboxed:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        raise NetworkSetupError("unshare (util-linux) is needed to run slirp4netns's sandbox")
    return [unshare, "--mount", "--propagation", "private", "--"]


async def _spawn_slirp(binary: str, netns: Path, log_path: Path, *, sandboxed: bool) -> UserNetwork:
    read_end, write_end = os.pipe()
    try:
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                [
                    *_private_mounts(sandboxed),
                    binary,
                    "--configure",
                    f"--mtu={_MTU}",
                    "--disable-host-loopback",
                    *(["--enable-sandbox"] if sandboxed else []),
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
                env={"PATH": TOOL_PATH},
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
    _SLIRPS[popen.pid] = popen
    return UserNetwork(pid=popen.pid, start_time=process_start_time(popen.pid) or 0)
