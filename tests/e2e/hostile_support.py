"""Helpers of the hostile-tenant suite (``test_hostile_tenant.py``): probe
programs that run inside a sandbox through the public API, the host's own
addresses, a host listener that counts who reached it, and the stack of each
backend.

A probe is a stdlib-only Python program. The ``scripted`` model writes it
into the workspace (``write``) and runs it (``$ python3 ...``) in one turn;
the probe prints one JSON object, which the test reads back from the turn's
``command_execution`` item (``sessions.turns.items.list``). Arguments travel
hex-encoded, so that a needle the probe looks for never appears in plain
text in its own command line (where its /proc scan would find it)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from e2e_stack import Stack, start_stack
from e2e_support import run_script
from openai.types.beta.agent_command_execution_item import AgentCommandExecutionItem

# The docker fixtures live beside the sandbox tests; the whole suite already
# has that directory on sys.path, a run of this file alone does not.
_SANDBOX_TESTS = str(Path(__file__).resolve().parents[1] / "sandbox")
if _SANDBOX_TESTS not in sys.path:
    sys.path.append(_SANDBOX_TESTS)

from conftest_docker import docker_engine, docker_test_image  # noqa: E402, F401 (fixtures)

__all__ = [
    "Probe",
    "run_probe",
    "run_command",
    "hex_args",
    "HostAddress",
    "host_addresses",
    "CountingListener",
    "counting_listener",
    "backend_stack",
    "sandbox_of",
    "host_view_of",
    "docker_engine",
    "docker_test_image",
    "TCP_PROBE",
    "IDENTITY_PROBE",
    "SCAN_PROBE",
    "FORK_PROBE",
    "DISK_PROBE",
]


@dataclass(frozen=True)
class Probe:
    exit_code: int | None
    output: str

    def json(self) -> dict[str, Any]:
        """The JSON object the probe printed last."""
        assert self.exit_code == 0, (self.exit_code, self.output[-4000:])
        value: dict[str, Any] = json.loads(self.output.strip().splitlines()[-1])
        return value


def hex_args(value: object) -> str:
    return json.dumps(value).encode().hex()


async def _command_items(client: openai.AsyncOpenAI, session_id: str, script: str, timeout: float) -> list[AgentCommandExecutionItem]:
    turn = await run_script(client, session_id, script, timeout=timeout)
    assert turn.status == "completed", turn
    items = [i async for i in client.beta.agents.sessions.turns.items.list(turn.id, session_id=session_id, order="asc")]
    commands = [i for i in items if isinstance(i, AgentCommandExecutionItem)]
    assert commands, items
    return commands


async def run_command(client: openai.AsyncOpenAI, session_id: str, command: str, *, timeout: float = 60.0) -> Probe:
    """Runs one shell command in the session's sandbox; its exit code and output."""
    *_, item = await _command_items(client, session_id, f"$ {command}", timeout)
    return Probe(item.exit_code, item.output or "")


async def run_probe(
    client: openai.AsyncOpenAI, session_id: str, source: str, args: object = None, *, timeout: float = 60.0
) -> Probe:
    """Writes ``source`` into the workspace and runs it with ``args``
    (hex-encoded JSON as its one argument), in one turn."""
    assert "```" not in source
    # Relative to the workspace, where commands start: the path means the
    # same for the file tools and the shell whatever the sandbox's layout.
    name = f".probe-{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    script = f"write {name}\n```\n{source}\n```\n$ python3 {name} {shlex.quote(hex_args(args))}"
    write, run = await _command_items(client, session_id, script, timeout)
    assert write.exit_code == 0, write
    return Probe(run.exit_code, run.output or "")


# --- the host -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostAddress:
    interface: str
    address: str
    family: int


def host_addresses() -> list[HostAddress]:
    """The host's own non-loopback addresses that a connection can name
    without a scope (``ip -j addr``: global and site scope, no link-local)."""
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, check=True, timeout=10).stdout
    found: list[HostAddress] = []
    for interface in json.loads(out):
        for info in interface.get("addr_info", ()):
            if info.get("scope") in ("host", "link") or not isinstance(info.get("local"), str):
                continue
            family = socket.AF_INET6 if info.get("family") == "inet6" else socket.AF_INET
            found.append(HostAddress(str(interface.get("ifname")), str(info["local"]), family))
    return found


@dataclass
class CountingListener:
    """A TCP listener on every host address (dual stack); counts connections."""

    port: int
    accepted: list[str] = field(default_factory=list)

    def connect_from_host(self, address: str) -> bool:
        try:
            socket.create_connection((address, self.port), timeout=3).close()
        except OSError:
            return False
        return True


@asynccontextmanager
async def counting_listener() -> AsyncIterator[CountingListener]:
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", 0))
    listener = CountingListener(port=sock.getsockname()[1])

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.accepted.append(str(writer.get_extra_info("peername")[0]))
        writer.close()

    server = await asyncio.start_server(accept, sock=sock)
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


async def sandbox_of(stack: Stack, environment_id: str) -> tuple[str, str]:
    """The sandbox of an environment and its organization's ID, as the
    operator sees them (an authenticated ListLabeledSandboxes)."""
    from grpc_support import internal_channel

    from berth.sandbox.v1 import sandbox_service_pb2 as pb, sandbox_service_pb2_grpc

    async with internal_channel(stack.settings.sandbox_addr) as channel:
        stub = sandbox_service_pb2_grpc.SandboxServiceStub(channel)
        listed = await stub.ListLabeledSandboxes(
            pb.ListLabeledSandboxesRequest(label_key="berth.environment_id"), metadata=(("x-berth-org", "org-a"),)
        )
    (found,) = [(s.sandbox_id, s.org_id) for s in listed.sandboxes if s.label_value == environment_id]
    return str(found[0]), str(found[1])


def host_view_of(marker: str) -> list[dict[str, list[str]]]:
    """The host's /proc status (Uid, Gid, CapEff) of every process whose
    command line carries ``marker``: how the host sees a sandbox's process."""
    found: list[dict[str, list[str]]] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() not in (proc / "cmdline").read_bytes():
                continue
            lines = (proc / "status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        found.append({key: fields[key].split() for key in ("Uid", "Gid", "CapEff")})
    return found


# --- stacks ---------------------------------------------------------------------------------


@asynccontextmanager
async def backend_stack(data_dir: Path, backend: str, docker_image: str | None = None) -> AsyncIterator[Stack]:
    """The whole stack on ``backend`` with its default settings; on docker,
    every container of the installation is destroyed at the end (the autouse
    reaper knows only local sandboxes)."""
    overrides: dict[str, object] = {}
    if backend == "docker":
        assert docker_image is not None
        overrides = {"sandbox_backend": "docker", "docker_image": docker_image}
    stack, stop = await start_stack(data_dir, **overrides)
    try:
        yield stack
    finally:
        await stop()  # type: ignore[misc]
        if backend == "docker":
            from services.sandbox.backends.docker import DockerBackend

            reaper = DockerBackend(stack.settings)
            for handle in await reaper.adopt():
                await reaper.destroy(handle)
            await reaper.close()


# --- probes (stdlib only: they run in any sandbox image with python3) -------------------------

_PREAMBLE = """\
import binascii, errno, json, os, socket, sys
ARGS = json.loads(binascii.unhexlify(sys.argv[1]).decode()) if len(sys.argv) > 1 else None
def err(exc):
    if isinstance(exc, socket.timeout):
        return "timeout"
    code = getattr(exc, "errno", None)
    return errno.errorcode.get(code, str(code)) if code else type(exc).__name__
"""

TCP_PROBE = _PREAMBLE + """\
# ARGS: {"targets": [[label, host, port]], "marker": str, "wait": [host, port]
# to wait for (bounded) first, "own_port": also try each own address on it}.
# Each target gets a
# verdict: "open" (connected; "reply_has_marker" tells whether what answered
# served the marker), or why it failed. With HTTP(S)_PROXY set, each target is
# also tried as a CONNECT through that proxy: "proxy:<status>" or the error.
import fcntl, struct, threading, urllib.parse

def own_addresses():
    found = []
    for _, name in socket.if_nameindex():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            found.append(socket.inet_ntoa(packed[20:24]))
        except OSError:
            pass
        finally:
            s.close()
    return found

def direct(host, port, marker):
    try:
        conn = socket.create_connection((host, port), timeout=3)
    except Exception as exc:
        return {"verdict": err(exc)}
    reply = b""
    try:
        conn.settimeout(3)
        conn.sendall(b"GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
        while len(reply) < 65536:
            data = conn.recv(65536)
            if not data:
                break
            reply += data
    except Exception:
        pass
    finally:
        conn.close()
    return {"verdict": "open", "reply_has_marker": bool(marker) and marker.encode() in reply}

def via_proxy(proxy, host, port):
    try:
        conn = socket.create_connection((proxy.hostname, proxy.port or 80), timeout=3)
    except Exception as exc:
        return "proxy-unreachable:" + err(exc)
    try:
        conn.settimeout(5)
        target = "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)
        conn.sendall(("CONNECT %s HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % (target, target)).encode())
        head = conn.recv(4096).split(b"\\r\\n", 1)[0].split()
        return "proxy:" + (head[1].decode() if len(head) > 1 else "no-status")
    except Exception as exc:
        return "proxy-error:" + err(exc)
    finally:
        conn.close()

def wait_open(host, port, timeout_s):
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

if ARGS.get("wait"):
    wait_open(ARGS["wait"][0], int(ARGS["wait"][1]), 15.0)
targets = [tuple(t) for t in ARGS["targets"]]
if ARGS.get("own_port"):
    targets += [("own:" + a, a, ARGS["own_port"]) for a in own_addresses()]
proxy_url = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy") or os.environ.get("HTTPS_PROXY") or ""
proxy = urllib.parse.urlsplit(proxy_url) if proxy_url else None
results, threads = {}, []
def run(label, host, port):
    entry = direct(host, port, ARGS.get("marker", ""))
    if proxy is not None:
        entry["proxy"] = via_proxy(proxy, host, port)
    results[label] = entry
for label, host, port in targets:
    thread = threading.Thread(target=run, args=(label, host, int(port)))
    thread.start()
    threads.append(thread)
for thread in threads:
    thread.join()
print(json.dumps({"targets": results, "proxy": proxy_url, "own_addresses": own_addresses()}))
"""

IDENTITY_PROBE = _PREAMBLE + """\
import subprocess
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
def readable(path):
    try:
        with open(path, "rb") as handle:
            handle.read(1)
        return "readable"
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return "unreadable:" + err(exc)
id_u = subprocess.run(["id", "-u"], capture_output=True, text=True)
print(json.dumps({
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
    "id_u": [id_u.returncode, id_u.stdout.strip()],
    "caps": {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")},
    "no_new_privs": status.get("NoNewPrivs", "").strip(),
    "files": {p: readable(p) for p in ("/etc/shadow", "/etc/gshadow", "/etc/passwd")},
}))
"""

SCAN_PROBE = _PREAMBLE + """\
# ARGS: {"needles": {label: text}, "paths": [host paths that must not exist]}.
# Looks for each needle in every file name of the tree (/proc, /sys and /dev
# aside), in the contents of every file up to 1 MiB outside the read-only OS
# trees, and in the cmdline and environ of every visible process and in
# this process's mount table.
needles = {label: text.encode() for label, text in ARGS["needles"].items()}
hits = {label: [] for label in needles}
SKIP_WALK = ("/proc", "/sys", "/dev")
SKIP_CONTENT = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
import time
deadline = time.monotonic() + ARGS.get("time_limit_s", 40)
walked = scanned = scanned_bytes = 0
complete = True
me = os.getpid()
for top, dirs, files in os.walk("/", onerror=lambda e: None):
    if time.monotonic() > deadline:
        complete = False
        break
    if top in SKIP_WALK:
        dirs[:] = []
        continue
    for name in dirs + files:
        walked += 1
        for label, needle in needles.items():
            if needle in name.encode(errors="surrogateescape"):
                hits[label].append("name:" + os.path.join(top, name))
    if top.startswith(SKIP_CONTENT) and top != "/":
        continue
    for name in files:
        path = os.path.join(top, name)
        try:
            if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 1 << 20:
                continue
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        if os.path.basename(path).startswith(".probe-"):
            continue
        scanned += 1
        scanned_bytes += len(data)
        for label, needle in needles.items():
            if needle in data:
                hits[label].append("content:" + path)
pids = [p for p in os.listdir("/proc") if p.isdigit()]
for pid in pids:
    if int(pid) == me:
        continue
    for part in ("cmdline", "environ"):
        try:
            with open("/proc/%s/%s" % (pid, part), "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        for label, needle in needles.items():
            if needle in data:
                hits[label].append("proc:%s/%s" % (pid, part))
mounts = open("/proc/self/mountinfo", "rb").read()
for label, needle in needles.items():
    if needle in mounts:
        hits[label].append("mountinfo")
print(json.dumps({
    "hits": hits, "present": {p: os.path.lexists(p) for p in ARGS["paths"]},
    "walked": walked, "scanned": scanned, "scanned_bytes": scanned_bytes, "pids": len(pids), "complete": complete,
}))
"""

FORK_PROBE = _PREAMBLE + """\
# Forks children that wait on a pipe until the parent stops (refused, or
# ARGS["max"] reached); closing the pipe then ends them all.
import time
read_end, write_end = os.pipe()
children, refused = [], None
try:
    for _ in range(ARGS["max"]):
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
        children.append(pid)
except OSError as exc:
    refused = err(exc)
os.close(write_end)
for pid in children:
    os.waitpid(pid, 0)
print(json.dumps({"forked": len(children), "refused": refused}))
"""

DISK_PROBE = _PREAMBLE + """\
# The workspace's size, an allocation past it, then real writes past what is
# left: each step reports what the filesystem said.
path = "/workspace/.fill"
st = os.statvfs("/workspace")
total_mib = st.f_blocks * st.f_frsize >> 20
result = {"total_mib": total_mib}
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
try:
    try:
        os.posix_fallocate(fd, 0, (total_mib + 64) << 20)
        result["allocate_past_size"] = "allocated"
    except OSError as exc:
        result["allocate_past_size"] = err(exc)
    # A refused allocation may keep the blocks it got before running out.
    os.ftruncate(fd, 0)
    free = os.statvfs("/workspace").f_bavail * st.f_frsize
    result["free_mib"] = free >> 20
    os.posix_fallocate(fd, 0, max(free - (32 << 20), 0))
    result["preallocated_mib"] = os.fstat(fd).st_blocks * 512 >> 20
finally:
    os.close(fd)
written, outcome = 0, "wrote everything"
try:
    with open("/workspace/.more", "wb") as handle:
        chunk = b"x" * (1 << 20)
        for _ in range(ARGS["write_mib"]):
            handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
            written += 1
except OSError as exc:
    outcome = err(exc)
result.update(write_past_quota=outcome, written_mib=written)
os.remove(path)
os.remove("/workspace/.more")
print(json.dumps(result))
"""
