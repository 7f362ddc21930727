"""The syscall filter of local sandboxes.

It denies what container runtimes deny by default (Docker's and Podman's
default profiles): creating or entering namespaces, mounting, loading
kernel code, keyrings (not namespaced), kernel tracing and BPF, changing the
clock, swap and reboot, and the raw handle and cross-process memory calls
that pierce the mount namespace or another process. Denied calls fail with
EPERM, so programs see an ordinary permission error; ``clone3`` fails with
ENOSYS, so the C library falls back to ``clone``, whose namespace flags the
filter can inspect. Calls of another ABI than the host's (i386 on x86_64)
kill the process, since the filter's rules are written for the native one.

The filter is compiled by the host's libseccomp (through ``pyseccomp``) once
per service process, to a BPF program that bubblewrap loads before it
starts the sandbox's first process; every process of the sandbox inherits it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["DENIED_SYSCALLS", "NAMESPACE_FLAGS", "SeccompUnavailable", "write_filter"]

DENIED_SYSCALLS: tuple[str, ...] = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "get_kernel_syms", "init_module",
    "io_uring_enter", "io_uring_register", "io_uring_setup", "ioperm", "iopl", "kexec_file_load",
    "kexec_load", "keyctl", "lookup_dcookie", "mount", "mount_setattr", "move_mount",
    "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open",
    "pivot_root", "process_vm_readv", "process_vm_writev", "query_module", "quotactl",
    "quotactl_fd", "reboot", "request_key", "setns", "settimeofday", "swapoff", "swapon", "sysfs",
    "_sysctl", "umount2", "unshare", "uselib", "userfaultfd", "ustat", "vm86", "vm86old",
)  # fmt: skip

# clone(2) flags that make a namespace.
NAMESPACE_FLAGS: tuple[int, ...] = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)


class SeccompUnavailable(Exception):
    """libseccomp is missing, so no filter can be compiled."""


def write_filter(path: Path) -> Path:
    """Compiles the filter to ``path`` (BPF, as bubblewrap's ``--seccomp``
    reads it) and returns it."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:  # OSError: libseccomp.so.2 is missing
        raise SeccompUnavailable(f"libseccomp is not usable (apt-get install libseccomp2): {exc}") from exc
    deny = sc.ERRNO(errno.EPERM)
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(deny, name)
        except (ValueError, RuntimeError, OSError):
            # A syscall this architecture does not have (vm86 on arm64).
            continue
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in NAMESPACE_FLAGS:
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        f.export_bpf(out)
    os.chmod(tmp, 0o644)
    tmp.replace(path)
    return path
