"""What confines a sandbox to its workspace and its network policy.

One module per mechanism, shared by both backends where the mechanism is the
same: ``sizes`` (what ``container_size`` grants), ``identity`` (the
unprivileged host uid of a sandbox), ``network`` (user-mode networking and
the egress filter inside the sandbox's own network namespace), ``quota``
(the workspace as a fixed-size filesystem), ``cgroups`` (memory, pids, CPU
and the freezer), ``seccomp`` (the syscall filter), ``etc`` (the minimal
``/etc`` a local sandbox sees) and ``preflight`` (what this host can enforce,
reported by ``berth status`` and checked before every create).
"""
