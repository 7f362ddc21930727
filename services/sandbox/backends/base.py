"""The interface every sandbox backend implements.

A backend only starts, freezes, thaws and removes sandboxes; everything that
happens inside one goes through sandboxd on the socket the backend exposes.

Every backend mounts the directory of that socket at ``/run/berth`` in the
sandbox. A ``restricted`` sandbox gets no network of its own; the Sandbox
service serves its egress proxy (``services/sandbox/egress.py``) on
``egress.sock`` in that directory, sandboxd relays
``127.0.0.1:EGRESS_PROXY_PORT`` to it, and ``egress_env()`` points the
commands' proxy variables at the relay.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from services.sandbox.isolation.sizes import DEFAULT_SIZE, ContainerSize

__all__ = [
    "NetworkPolicy",
    "SandboxSpec",
    "BackendHandle",
    "SandboxBackend",
    "BackendError",
    "BackendUnavailable",
    "SandboxStartError",
    "SandboxGone",
    "proxy_env",
    "egress_env",
    "EGRESS_PROXY_PORT",
    "EGRESS_SOCKET_NAME",
    "EGRESS_SOCKET_IN_SANDBOX",
]

NetworkPolicy = Literal["enabled", "disabled", "restricted"]

# Where sandboxd relays a restricted sandbox's proxy connections from (its
# own network namespace, so no port clash between sandboxes) and to.
EGRESS_PROXY_PORT = 3128
EGRESS_SOCKET_NAME = "egress.sock"
EGRESS_SOCKET_IN_SANDBOX = "/run/berth/" + EGRESS_SOCKET_NAME


class BackendError(Exception):
    """A backend operation failed."""


class BackendUnavailable(BackendError):
    """The backend cannot run on this host (e.g. bubblewrap is not installed)."""


class SandboxStartError(BackendError):
    """The sandbox process started but its daemon never became ready."""


class SandboxGone(BackendError):
    """The sandbox's processes no longer exist."""


@dataclass(frozen=True)
class SandboxSpec:
    """What to create. The backend chooses the host directories (workspace,
    socket and state) itself, so that ``adopt`` can find every sandbox again
    and ``destroy`` deletes only what the backend made; the handle reports
    them. The domain lists of a ``restricted`` sandbox are enforced by its
    egress proxy, not by the backend, which only keeps the sandbox off the
    network."""

    sandbox_id: str
    network: NetworkPolicy = "disabled"
    allowed_domains: tuple[str, ...] = ()
    blocked_domains: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    size: ContainerSize = DEFAULT_SIZE
    """The limits the backend enforces (``isolation/sizes.py``)."""

    @property
    def cpu_millis(self) -> int:
        return self.size.cpu_millis

    @property
    def memory_mib(self) -> int:
        return self.size.memory_mib


@dataclass(frozen=True)
class BackendHandle:
    """A running sandbox. ``private`` holds backend-specific JSON values (pid,
    host directories, freezer) and survives a round trip through JSON."""

    sandbox_id: str
    socket_path: str
    private: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"sandbox_id": self.sandbox_id, "socket_path": self.socket_path, "private": self.private})

    @classmethod
    def from_json(cls, text: str) -> BackendHandle:
        raw = json.loads(text)
        return cls(sandbox_id=str(raw["sandbox_id"]), socket_path=str(raw["socket_path"]), private=dict(raw["private"]))


class SandboxBackend(ABC):
    """Lifecycle of sandboxes on one host."""

    name: str

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> BackendHandle:
        """Starts the sandbox and returns once its daemon accepts connections.
        Creating a sandbox that is already running returns its handle; an
        existing workspace is reused, never wiped."""

    @abstractmethod
    async def pause(self, handle: BackendHandle) -> None:
        """Freezes every process of the sandbox after flushing written files."""

    @abstractmethod
    async def resume(self, handle: BackendHandle) -> None:
        """Thaws the sandbox. Resuming a running sandbox does nothing."""

    @abstractmethod
    async def destroy(self, handle: BackendHandle) -> None:
        """Stops every process of the sandbox and deletes its directories."""

    @abstractmethod
    def socket_path(self, handle: BackendHandle) -> str:
        """Host path of the daemon's unix socket."""

    @abstractmethod
    async def adopt(self) -> list[BackendHandle]:
        """Handles of sandboxes still running from an earlier service process."""

    @abstractmethod
    async def is_alive(self, handle: BackendHandle) -> bool:
        """Whether the sandbox's processes still exist (paused counts as alive)."""

    async def start(self) -> None:
        """Starts the backend's background work (the docker backend's warm
        pool); called once, after ``adopt``. Sandboxes can be created
        without it."""

    async def close(self) -> None:
        """Stops the background work and removes what only it made;
        sandboxes keep running (``adopt`` finds them again)."""

    def leftover_handle(self, sandbox_id: str) -> BackendHandle | None:
        """A handle to what a create that never returned one may have left
        behind (container, directories), for ``destroy``; None when the
        backend cannot name it."""
        return None

    def egress_socket_path(self, handle: BackendHandle) -> str | None:
        """Host path on which the service serves the egress proxy of a
        ``restricted`` sandbox (``handle.private["network"]``); None when
        the sandbox does not use one."""
        if handle.private.get("network") != "restricted":
            return None
        return os.path.join(os.path.dirname(self.socket_path(handle)), EGRESS_SOCKET_NAME)


def proxy_env(http_proxy: str, https_proxy: str, no_proxy: str) -> dict[str, str]:
    """Proxy variables for sandbox commands, in both spellings tools read."""
    env: dict[str, str] = {}
    for key, value in (("HTTP_PROXY", http_proxy), ("HTTPS_PROXY", https_proxy), ("NO_PROXY", no_proxy)):
        if value:
            env[key] = value
            env[key.lower()] = value
    return env


def egress_env() -> dict[str, str]:
    """Proxy variables of a restricted sandbox's commands: every HTTP(S)
    request goes to sandboxd's relay of the egress proxy. They replace any
    host proxy (the egress proxy chains through that itself)."""
    relay = f"http://127.0.0.1:{EGRESS_PROXY_PORT}"
    return proxy_env(relay, relay, "localhost,127.0.0.1")
