"""The one generator entry point for Berth's protobuf contracts.

Emits ``*_pb2.py``, ``*_pb2.pyi`` (mypy-protobuf) and ``*_pb2_grpc.py`` beside
each ``.proto`` under ``protos/``, or under ``--out`` for the drift check.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(sys.executable).parent
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={include}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Package markers so `berth.session.v1` imports from the generated tree.
    for proto in proto_files():
        pkg = out_dir / proto.parent.relative_to(PROTO_ROOT)
        while pkg != out_dir:
            (pkg / "__init__.py").touch()
            pkg = pkg.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    args = parser.parse_args()
    if args.out != PROTO_ROOT and args.out.exists():
        shutil.rmtree(args.out)
    generate(args.out)


if __name__ == "__main__":
    main()
