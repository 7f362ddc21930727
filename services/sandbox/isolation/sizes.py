"""What each ``container_size`` grants a sandbox: the one table of limits."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ContainerSize", "SIZES", "DEFAULT_SIZE", "size_for"]


@dataclass(frozen=True)
class ContainerSize:
    name: str
    cpu_millis: int
    memory_mib: int
    """Memory including swap: a sandbox never swaps past it."""
    pids: int
    disk_mib: int
    """Size of the workspace filesystem; a write past it fails with ENOSPC."""
    tmp_mib: int
    """Size of the sandbox's ``/tmp`` (memory-backed, counted in ``memory_mib``)."""


SIZES: dict[str, ContainerSize] = {
    "small": ContainerSize("small", cpu_millis=1000, memory_mib=1024, pids=256, disk_mib=4096, tmp_mib=256),
    "medium": ContainerSize("medium", cpu_millis=2000, memory_mib=4096, pids=512, disk_mib=10240, tmp_mib=512),
    "large": ContainerSize("large", cpu_millis=4000, memory_mib=8192, pids=1024, disk_mib=20480, tmp_mib=1024),
}

# The SDK: "Omission selects the medium tier."
DEFAULT_SIZE = SIZES["medium"]

# Index of the proto enum berth.common.v1.ContainerSize.
_BY_ENUM = {0: DEFAULT_SIZE, 1: SIZES["small"], 2: SIZES["medium"], 3: SIZES["large"]}


def size_for(enum_value: int) -> ContainerSize:
    """The size of a CreateSandbox request's ``size`` (an unknown value is the default)."""
    return _BY_ENUM.get(enum_value, DEFAULT_SIZE)
