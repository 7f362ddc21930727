"""The host identity a sandbox runs as.

Every sandbox gets its own unprivileged host uid and gid, derived from the
install (its data directory) and the sandbox ID, so that two sandboxes never
share one even across installs on a host, and a restarted service finds the
same uid again. The uids lie far above any uid a distribution allocates
(``/etc/login.defs`` stops at 60000, subordinate ranges of
``/etc/subuid`` start at 100000 and are 65536 wide per user). Inside the
sandbox the uid reads as ``SANDBOX_UID`` (an ordinary user, ``sandbox``).
"""

from __future__ import annotations

import hashlib

__all__ = ["SANDBOX_UID", "SANDBOX_GID", "SANDBOX_USER", "UID_BASE", "UID_SPAN", "host_uid"]

SANDBOX_UID = 1000
SANDBOX_GID = 1000
SANDBOX_USER = "sandbox"

UID_BASE = 1_000_000_000
UID_SPAN = 1_000_000_000


def host_uid(install: str, sandbox_id: str, salt: int = 0) -> int:
    """The host uid (and gid) of ``sandbox_id`` in the install ``install``;
    ``salt`` picks another one when the first collides with a live sandbox."""
    digest = hashlib.sha256(f"{install}\0{sandbox_id}\0{salt}".encode()).digest()
    return UID_BASE + int.from_bytes(digest[:8], "big") % UID_SPAN
