"""sandboxd as one file: a stdlib zipapp built from the ``sandboxd`` package.

Backends bind-mount a single file into each sandbox and run it with the
sandbox's own ``python3`` (``python3 sandboxd.pyz --socket ...``). The
archive is reproducible: its entries are the package's ``.py`` files in
sorted order, stored uncompressed with a fixed timestamp and mode, so the same
sources always give the same bytes. Beside each ``.py`` is its bytecode for
this interpreter's version (an unchecked hash-based ``.pyc``, PEP 552), so a
sandbox running the same Python starts without compiling the daemon (which
matters every time a dormant daemon wakes); any other version ignores it
(zipimport rejects its magic number) and compiles the source. ``build`` names the file by its content
and writes it with an atomic rename, so a file a running sandbox has mounted
is never rewritten and concurrent builders agree on the result.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import marshal
import os
import secrets
import zipapp
import zipfile
from pathlib import Path

__all__ = ["PACKAGE", "archive", "build"]

# The package shipped: services/sandbox/daemon/sandboxd/.
PACKAGE = Path(__file__).resolve().parent / "sandboxd"
_INTERPRETER = "/usr/bin/env python3"
_EPOCH = (1980, 1, 1, 0, 0, 0)
# Runs the package's command line from the archive's root.
_MAIN = b"import sys\n\nfrom sandboxd.__main__ import main\n\nsys.exit(main())\n"


def _sources() -> list[tuple[str, Path]]:
    """(archive name, source file) for every module of the package."""
    found = sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)
    return [(f"sandboxd/{path.relative_to(PACKAGE).as_posix()}", path) for path in found]


def _entry(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o100644 << 16
    return info


def _bytecode(name: str, source: bytes) -> bytes:
    code = compile(source, name, "exec", dont_inherit=True)
    # PEP 552: magic, flags (1: hash-based, source not checked), hash, code.
    return importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + importlib.util.source_hash(source) + marshal.dumps(code)


@functools.lru_cache(maxsize=4)
def _archive(stamp: tuple[tuple[str, int, int], ...]) -> bytes:
    del stamp  # the cache key: sources unchanged since the last build
    plain = io.BytesIO()
    with zipfile.ZipFile(plain, "w") as bundle:
        for name, source in [("__main__.py", _MAIN)] + [(name, path.read_bytes()) for name, path in _sources()]:
            bundle.writestr(_entry(name), source)
            bundle.writestr(_entry(name + "c"), _bytecode(name, source))
    plain.seek(0)
    shebanged = io.BytesIO()
    zipapp.create_archive(plain, shebanged, interpreter=_INTERPRETER)
    return shebanged.getvalue()


def archive() -> bytes:
    """The zipapp's bytes, built from the package as it is on disk now."""
    stamp = []
    for name, path in _sources():
        info = path.stat()
        stamp.append((name, info.st_size, info.st_mtime_ns))
    return _archive(tuple(stamp))


def build(directory: Path) -> Path:
    """Writes the zipapp into ``directory`` as ``sandboxd-<hash>.pyz``
    (readable by everyone, writable by no one) unless it is there already,
    and returns its path."""
    data = archive()
    target = directory / f"sandboxd-{hashlib.sha256(data).hexdigest()[:16]}.pyz"
    if not target.exists():
        directory.mkdir(parents=True, exist_ok=True)
        # Unique per call: threads and processes may build at once.
        tmp = directory / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.write_bytes(data)
        tmp.chmod(0o444)
        tmp.replace(target)
    return target
