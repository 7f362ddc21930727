"""The contracts: generated code matches the protos, buf lint passes, and the
ownership boundaries hold."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _generated(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in root.rglob("*")
        if p.is_file() and (p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")))
    }


def test_committed_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)], check=True, capture_output=True)
    fresh = _generated(out)
    committed = _generated(ROOT / "protos")
    assert fresh, "generator produced nothing"
    assert sorted(fresh) == sorted(committed)
    drifted = [name for name in fresh if not filecmp.cmp(fresh[name], committed[name], shallow=False)]
    assert drifted == []


def test_protos_pass_buf_lint() -> None:
    result = subprocess.run([_buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _buf() -> str:
    buf = shutil.which("buf", path=str(BIN)) or shutil.which("buf")
    if buf is None:
        pytest.fail("buf is not installed (pip install buf-bin)")
    return buf


def test_protos_stay_wire_compatible_with_the_previous_commit() -> None:
    """``buf breaking`` (WIRE_JSON, see buf.yaml) against the first parent:
    for a merge that is main before the branch, so the branch's whole change
    is checked. Removed fields must be ``reserved``."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    parent = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD~1"], cwd=ROOT, capture_output=True, text=True)
    if parent.returncode != 0:
        pytest.skip("HEAD has no parent commit to compare with")
    result = subprocess.run(
        [_buf(), "breaking", "--against", f".git#ref={parent.stdout.strip()}"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_boundaries_hold() -> None:
    lint = shutil.which("lint-imports", path=str(BIN)) or shutil.which("lint-imports")
    assert lint is not None
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sandbox_daemon_imports_only_the_standard_library() -> None:
    """Every module of the sandboxd package, imported as the zipapp imports
    it (top-level ``sandboxd``), pulls in nothing outside the stdlib."""
    daemon = ROOT / "services" / "sandbox" / "daemon"
    code = (
        "import sys, pkgutil, importlib\n"
        f"sys.path.insert(0, {str(daemon)!r})\n"
        "before = set(sys.modules)\n"
        "import sandboxd\n"
        "for info in pkgutil.walk_packages(sandboxd.__path__, 'sandboxd.'):\n"
        "    importlib.import_module(info.name)\n"
        "stdlib = sys.stdlib_module_names\n"
        "bad = sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(stdlib) - {'sandboxd'})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_services_and_gateway_type_check_in_strict_mode(tmp_path: Path) -> None:
    mypy = shutil.which("mypy", path=str(BIN)) or shutil.which("mypy")
    assert mypy is not None
    result = subprocess.run(
        [mypy, "--cache-dir", str(tmp_path / "mypy-cache"), "services", "gateway"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
