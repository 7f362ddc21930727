"""sandboxd ships into sandboxes as one zipapp built from its package
(``services/sandbox/daemon/bundle.py``)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from services.sandbox.daemon import bundle


def test_the_same_sources_build_the_same_bytes_under_the_same_name(tmp_path: Path) -> None:
    first = bundle.build(tmp_path / "one")
    second = bundle.build(tmp_path / "two")

    assert first.name == second.name
    assert first.name.startswith("sandboxd-") and first.suffix == ".pyz"
    assert first.read_bytes() == second.read_bytes()
    assert stat.S_IMODE(first.stat().st_mode) == 0o444


def test_building_again_keeps_the_file_a_sandbox_may_have_mounted(tmp_path: Path) -> None:
    built = bundle.build(tmp_path)
    inode = built.stat().st_ino

    assert bundle.build(tmp_path) == built
    assert built.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.name]


def test_a_changed_source_builds_under_a_new_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "sandboxd"
    shutil.copytree(bundle.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(bundle, "PACKAGE", package)
    before = bundle.build(tmp_path / "out")

    with (package / "relay.py").open("a") as source:
        source.write("# changed\n")

    after = bundle.build(tmp_path / "out")
    assert after != before
    assert b"# changed\n" in after.read_bytes()


def test_the_archive_holds_the_package_sources_and_their_bytecode_and_runs_with_a_plain_python(tmp_path: Path) -> None:
    built = bundle.build(tmp_path)
    with zipfile.ZipFile(built) as archive:
        names = archive.namelist()
    expected = {f"sandboxd/{p.relative_to(bundle.PACKAGE).as_posix()}" for p in bundle.PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}

    sources = expected | {"__main__.py"}
    assert set(names) == sources | {name + "c" for name in sources}
    # -I: nothing but the archive itself on the path, as in a sandbox image.
    result = subprocess.run([sys.executable, "-I", str(built), "--help"], capture_output=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.startswith(b"usage: sandboxd")


def test_a_python_of_another_version_ignores_the_bytecode_and_runs_the_sources(tmp_path: Path) -> None:
    built = bundle.build(tmp_path)
    stale = tmp_path / "stale.pyz"
    with zipfile.ZipFile(built) as archive, zipfile.ZipFile(stale, "w") as copy:
        for info in archive.infolist():
            data = archive.read(info)
            # Another interpreter's magic number: zipimport must fall back to the source.
            copy.writestr(info, b"\x00\x00" + data[2:] if info.filename.endswith(".pyc") else data)

    result = subprocess.run([sys.executable, "-I", str(stale), "--help"], capture_output=True, timeout=30)
    assert result.returncode == 0
    assert result.stdout.startswith(b"usage: sandboxd")


def test_the_full_daemon_loads_no_tls_or_hash_library(tmp_path: Path) -> None:
    # Every module the full daemon imports is paid on each wake from
    # dormancy; OpenSSL (ssl, or hashlib through secrets) also costs ~1 MiB.
    built = bundle.build(tmp_path)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.modules['ssl'] = None\n"
        "import sandboxd.cli\n"
        "print(' '.join(sorted(m for m in ('_ssl', '_hashlib', 'hashlib', 'secrets', 'hmac') if sys.modules.get(m))))"
    )
    loaded = subprocess.run([sys.executable, "-I", "-S", "-c", probe, str(built)], capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == []
