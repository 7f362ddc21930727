"""A local sandbox, probed as a hostile tenant would probe it from inside:
identity, files, syscalls, limits and network all confine it (issue 11)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from pathlib import Path

import pytest
from hosts_support import http_server_on, make_test_host
from sandbox_support import Sandbox, SandboxFactory
from waiting import wait_until

from services.sandbox.backends.base import SandboxSpec
from services.sandbox.isolation.network import host_addresses
from services.sandbox.isolation.sizes import ContainerSize

pytestmark = pytest.mark.timeout(120)

# A small size, so the limits are reached quickly.
TINY = ContainerSize("tiny", cpu_millis=500, memory_mib=128, pids=64, disk_mib=64, tmp_mib=16)


def _host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


async def test_commands_run_as_an_unprivileged_user_with_no_capabilities(sandbox: Sandbox) -> None:
    result = await sandbox.client.run(shell="id -u; grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status")
    lines = result.stdout.decode().split("\n")

    assert result.exit_code == 0, result.stderr
    assert lines[0] == "1000"
    assert all(line.split()[1] == "0000000000000000" for line in lines[1:4]), lines
    # Seen from the host, the sandbox's processes run as its own unprivileged uid.
    assert sandbox.handle.private["uid"] >= 1_000_000_000
    assert _host_uid(int(sandbox.handle.private["inner_pid"])) == sandbox.handle.private["uid"]


async def test_two_sandboxes_never_share_a_host_uid(make_sandbox: SandboxFactory) -> None:
    first = await make_sandbox("uid-a")
    second = await make_sandbox("uid-b")

    assert first.handle.private["uid"] != second.handle.private["uid"]


async def test_the_hosts_etc_and_other_files_are_not_visible(make_sandbox: SandboxFactory) -> None:
    victim = await make_sandbox("victim")
    await victim.client.write_file("/workspace/secret.txt", b"victim's secret")
    attacker = await make_sandbox("attacker")
    victim_home = str(victim.handle.private["home"])

    result = await attacker.client.run(
        shell=(
            "test -e /etc/shadow && echo shadow; "
            "cat /etc/passwd | cut -d: -f1 | tr '\\n' ' '; echo; "
            f"ls {victim_home} 2>/dev/null && echo home-visible; "
            "ls / | tr '\\n' ' '; echo; "
            "cat /workspace/secret.txt 2>/dev/null || echo no-secret"
        )
    )
    out = result.stdout.decode()

    assert "shadow" not in out.split("\n")[0]
    assert out.split("\n")[0].split() == ["root", "sandbox", "nobody"]
    assert "home-visible" not in out
    assert "root" not in out.split("\n")[1].split()
    assert "no-secret" in out


async def test_the_syscall_filter_refuses_namespaces_and_mounts(sandbox: Sandbox) -> None:
    probe = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, call in (('unshare', lambda: libc.unshare(0x10000000)), ('mount', lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)),\n"
        "                   ('keyctl', lambda: libc.syscall(250, 0, 0, 0, 0, 0))):\n"
        "    print(name, call(), ctypes.get_errno())\n"
    )
    result = await sandbox.client.run(argv=["python3", "-c", probe])

    assert result.exit_code == 0, result.stderr
    for line in result.stdout.decode().splitlines():
        name, code, errno = line.split()
        assert (code, errno) == ("-1", "1"), line


async def test_a_command_over_its_memory_is_killed_and_the_sandbox_goes_on(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("memory", size=TINY)

    hog = await sandbox.client.run(argv=["python3", "-c", "b = bytearray(512 * 1024 * 1024); print('allocated')"], timeout_s=60)
    after = await sandbox.client.run(shell="echo still here")

    assert hog.exit_code != 0 and b"allocated" not in hog.stdout
    assert after.exit_code == 0 and after.stdout == b"still here\n"


async def test_a_fork_bomb_stops_at_the_pids_limit_and_the_sandbox_goes_on(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("forks", size=TINY)
    bomb = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    for _ in range(1000):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        children += 1\n"
        "except OSError as exc:\n"
        "    print('refused after', children, exc.errno)\n"
    )

    result = await sandbox.client.run(argv=["python3", "-c", bomb], timeout_s=60)
    await sandbox.client.run(shell="pkill -KILL -f 'time.sleep' || true")
    after = await sandbox.client.run(shell="echo alive")

    words = result.stdout.decode().split()
    assert words[:2] == ["refused", "after"], (result.stdout, result.stderr)
    assert int(words[2]) < TINY.pids
    assert words[3] == "11"  # EAGAIN
    assert after.stdout == b"alive\n"


async def test_a_write_past_the_disk_quota_fails_with_enospc(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("disk", size=TINY)
    fill = (
        "import errno\n"
        "try:\n"
        "    with open('/workspace/big', 'wb') as f:\n"
        "        for _ in range(200):\n"
        "            f.write(b'x' * 1024 * 1024)\n"
        "            f.flush()\n"
        "    print('wrote everything')\n"
        "except OSError as exc:\n"
        "    print('refused', errno.errorcode[exc.errno])\n"
    )

    result = await sandbox.client.run(argv=["python3", "-c", fill], timeout_s=60)
    cleanup = await sandbox.client.run(shell="rm /workspace/big && echo ok > /workspace/small && cat /workspace/small")

    assert result.stdout == b"refused ENOSPC\n", result.stderr
    assert cleanup.stdout == b"ok\n"


@pytest.mark.parametrize("network", ["disabled", "restricted", "enabled"])
async def test_no_host_address_or_private_range_is_reachable(make_sandbox: SandboxFactory, network: str) -> None:
    sandbox = await make_sandbox(f"net-{network}", network=network)
    server = await asyncio.start_server(lambda r, w: w.close(), "0.0.0.0", 0, family=socket.AF_INET)
    port = server.sockets[0].getsockname()[1]
    targets = [("127.0.0.1", port), ("127.0.0.1", 5432), ("169.254.169.254", 80), ("10.0.2.2", port)]
    targets += [(a, port) for a in host_addresses() if ":" not in a and not a.startswith("127.")]
    probe = (
        "import socket, sys\n"
        "for t in sys.argv[1:]:\n"
        "    host, port = t.rsplit(':', 1)\n"
        "    try:\n"
        "        socket.create_connection((host, int(port)), timeout=3).close(); print(t, 'open')\n"
        "    except OSError:\n"
        "        print(t, 'refused')\n"
    )
    try:
        result = await sandbox.client.run(argv=["python3", "-c", probe, *[f"{h}:{p}" for h, p in targets]], timeout_s=60)
    finally:
        server.close()
        await server.wait_closed()

    verdicts = dict(line.split() for line in result.stdout.decode().splitlines())
    assert len(verdicts) == len(targets), result.stderr
    assert set(verdicts.values()) == {"refused"}, verdicts


async def test_an_enabled_sandbox_reaches_a_test_host_only_when_its_range_is_allowed(make_sandbox: SandboxFactory) -> None:
    with make_test_host() as host, http_server_on(host, "from the test host") as url:
        fetch = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
        allowed = await make_sandbox("allowed", network="enabled", allow_cidrs=(host.cidr,))
        reached = await allowed.client.run(argv=["python3", "-c", fetch], timeout_s=30)
        denied = await make_sandbox("denied", network="enabled")
        refused = await denied.client.run(argv=["python3", "-c", fetch], timeout_s=30)
        isolated = await make_sandbox("isolated", network="disabled", allow_cidrs=(host.cidr,))
        unreachable = await isolated.client.run(argv=["python3", "-c", fetch], timeout_s=30)

    assert (reached.exit_code, reached.stdout) == (0, b"from the test host\n"), reached.stderr
    assert refused.exit_code != 0
    assert unreachable.exit_code != 0


async def test_starting_an_enabled_sandbox_leaves_the_hosts_mounts_alone(make_sandbox: SandboxFactory) -> None:
    with make_test_host() as host:
        before = _mounts_under("/run/netns")
        await make_sandbox("mounts", network="enabled")
        after = _mounts_under("/run/netns")
        entered = subprocess.run(["nsenter", f"--net=/run/netns/{host.name}", "--", "true"], capture_output=True)

    assert f"/run/netns/{host.name}" in before
    assert before <= after
    assert entered.returncode == 0, entered.stderr


def _mounts_under(prefix: str) -> set[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        points = {line.split()[4] for line in mountinfo}
    return {point for point in points if point.startswith(prefix + "/")}


async def test_each_sandbox_has_its_own_network_namespace(make_sandbox: SandboxFactory) -> None:
    first = await make_sandbox("ns-a", network="enabled")
    second = await make_sandbox("ns-b", network="enabled")

    namespaces = {os.readlink(f"/proc/{s.handle.private['inner_pid']}/ns/net") for s in (first, second)}

    assert len(namespaces) == 2
    assert os.readlink("/proc/self/ns/net") not in namespaces


async def test_a_background_processs_output_never_lands_on_the_hosts_disk(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("chatty", size=TINY)
    host_state = Path(str(sandbox.handle.private["run_dir"])) / "berth" / "state"

    started = await sandbox.client.start_process(name="chatty", shell="head -c 64000000 /dev/zero")
    status = await sandbox.client.wait_process(started.process_id, 60)
    on_host = sum(p.stat().st_size for p in host_state.rglob("*") if p.is_file())
    after = await sandbox.client.run(shell="echo alive")

    assert status is not None
    assert on_host < 1024 * 1024
    assert after.stdout == b"alive\n"


async def test_recreating_a_sandbox_that_died_stops_the_user_network_it_left(make_sandbox: SandboxFactory) -> None:
    sandbox = await make_sandbox("phoenix", network="enabled")
    first_slirp = int(sandbox.handle.private["user_network"]["pid"])
    os.kill(int(sandbox.handle.private["pid"]), 9)
    await wait_until(lambda: not sandbox.backend._alive(sandbox.handle), what="the sandbox died")

    again = await sandbox.backend.create(SandboxSpec(sandbox_id="phoenix", network="enabled"))

    def first_slirp_gone() -> bool:
        try:
            return Path(f"/proc/{first_slirp}/stat").read_text().split(")")[1].split()[0] == "Z"
        except OSError:
            return True

    await wait_until(first_slirp_gone, what="the dead sandbox's slirp4netns ended")
    assert int(again.private["user_network"]["pid"]) != first_slirp
    await sandbox.backend.destroy(again)
