"""Docker helpers for sandbox tests, imported explicitly by the tests that
need an engine (``from conftest_docker import ...``).

Without a reachable engine, or when the test image cannot be built, tests
skip with the reason; with ``BERTH_REQUIRE_DOCKER=1`` (CI) they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest

from services.sandbox.backends.docker import installation_id


__all__ = ["DOCKER_TEST_IMAGE", "require_docker_or_skip", "docker_engine", "docker_test_image", "host_address", "remove_containers_of"]

DOCKER_TEST_IMAGE = os.environ.get("BERTH_TEST_DOCKER_IMAGE", "berth-base:bookworm")
_BUILD_BASE = Path(__file__).resolve().parents[2] / "deploy" / "images" / "build-base.sh"


def require_docker_or_skip(reason: str) -> None:
    if os.environ.get("BERTH_REQUIRE_DOCKER") == "1":
        pytest.fail(f"Docker is required here (BERTH_REQUIRE_DOCKER=1) but unavailable: {reason}")
    pytest.skip(f"Docker unavailable: {reason}")


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env(version="auto", timeout=30)
        client.ping()
    except docker.errors.DockerException as exc:
        require_docker_or_skip(f"no engine reachable ({exc}); start dockerd or run deploy/ci/setup-docker.sh")
    yield client
    client.close()


@pytest.fixture(scope="session")
def docker_test_image(docker_engine: docker.DockerClient) -> str:
    """The sandbox image of the tests, built by deploy/images/build-base.sh
    when missing (about 40 s, needs the Debian mirror)."""
    try:
        docker_engine.images.get(DOCKER_TEST_IMAGE)
        return DOCKER_TEST_IMAGE
    except docker.errors.ImageNotFound:
        pass
    result = subprocess.run(
        ["bash", str(_BUILD_BASE), DOCKER_TEST_IMAGE], capture_output=True, text=True, timeout=900, check=False
    )
    if result.returncode != 0:
        require_docker_or_skip(f"could not build {DOCKER_TEST_IMAGE}: {result.stderr[-2000:]}")
    return DOCKER_TEST_IMAGE


def host_address() -> str:
    """An IPv4 address of this host that is not loopback, from ``ip -j addr``:
    where a listener of the test is reachable only for a sandbox allowed it
    (``BERTH_SANDBOX_ALLOW_CIDRS``), never for one with network disabled."""
    out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, check=True, timeout=10).stdout
    for interface in json.loads(out):
        for info in interface.get("addr_info", ()):
            if info.get("family") == "inet" and info.get("scope") == "global":
                return str(info["local"])
    pytest.skip("this host has no IPv4 address besides loopback")


def remove_containers_of(engine: docker.DockerClient, data_dir: Path) -> None:
    """Removes every container of the installation at ``data_dir``: whatever
    a failed test left behind."""
    label = f"berth.installation={installation_id(data_dir)}"
    for container in engine.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)
