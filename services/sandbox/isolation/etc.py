"""The ``/etc`` a local sandbox sees: made for it, never the host's.

Generated: ``passwd`` and ``group`` (root, the sandbox user, nobody),
``hosts``, ``hostname``, ``resolv.conf`` (slirp4netns's DNS forwarder) and
``nsswitch.conf``; the CA bundle (``BERTH_SANDBOX_CA_BUNDLE``, default the
host's) at ``ssl/certs/ca-certificates.crt``. Copied from the host, because
ordinary programs need them and they hold nothing secret: the dynamic
linker's cache and configuration, ``alternatives`` (Debian's ``awk``,
``editor`` ... links), and a short list of data files. Nothing else: no
shadow, no ssh keys, no machine-id, no service configuration.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from services.sandbox.isolation.identity import SANDBOX_GID, SANDBOX_UID, SANDBOX_USER
from services.sandbox.isolation.network import SLIRP_DNS

__all__ = ["build_etc", "COPIED"]

COPIED: tuple[str, ...] = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone",
    "mime.types", "protocols", "services", "ethertypes", "gai.conf", "host.conf", "inputrc",
    "bash.bashrc", "profile", "debian_version", "os-release", "ssl/openssl.cnf",
    "python3", "python3.11", "python3.12", "python3.13", "magic", "magic.mime", "mailcap",
)  # fmt: skip

_HOME = "/workspace"


def _files(hostname: str) -> dict[str, str]:
    return {
        "passwd": (
            "root:x:0:0:root:/root:/bin/sh\n"
            f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{_HOME}:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ),
        "group": f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "hostname": f"{hostname}\n",
        "resolv.conf": f"nameserver {SLIRP_DNS}\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n",
    }


def build_etc(parent: Path, *, ca_bundle: Path | None, hostname: str = "sandbox", host_etc: Path = Path("/etc")) -> Path:
    """Builds the directory under ``parent``, named by its content, and
    returns it. A directory a running sandbox binds is never changed: a host
    whose files changed gets a new directory beside it."""
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".etc-", dir=parent))
    try:
        for name, text in _files(hostname).items():
            (staging / name).write_text(text)
        for name in COPIED:
            source = host_etc / name
            if not source.exists():
                continue
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, dest, symlinks=True)
            else:
                shutil.copy2(source, dest, follow_symlinks=True)
        certs = staging / "ssl" / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        if ca_bundle is not None and ca_bundle.is_file():
            shutil.copyfile(ca_bundle, certs / "ca-certificates.crt")
        digest = hashlib.sha256()
        for path in sorted([staging, *staging.rglob("*")]):
            digest.update(str(path.relative_to(staging)).encode())
            if path.is_symlink():
                digest.update(os.readlink(path).encode())
            else:
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
                if path.is_file():
                    digest.update(path.read_bytes())
        target = parent / f"etc-{digest.hexdigest()[:16]}"
        if not target.exists():
            staging.replace(target)
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
