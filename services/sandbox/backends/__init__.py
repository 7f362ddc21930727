"""Sandbox backends: where and how sandboxes run."""

from services.sandbox.backends.base import (
    BackendError,
    BackendHandle,
    BackendUnavailable,
    NetworkPolicy,
    SandboxBackend,
    SandboxGone,
    SandboxSpec,
    SandboxStartError,
)

__all__ = [
    "BackendError",
    "BackendHandle",
    "BackendUnavailable",
    "NetworkPolicy",
    "SandboxBackend",
    "SandboxGone",
    "SandboxSpec",
    "SandboxStartError",
]
