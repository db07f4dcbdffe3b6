"""Generate the Python stubs (with .pyi types) of proto/ into OUT/jobplane/v1.

Usage: python scripts/protogen.py OUT    (``make proto`` runs it with OUT=src)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
INIT = '"""Generated from proto/jobplane/v1 by `make proto`. Do not edit."""\n'


def generate(out: Path) -> list[Path]:
    """Write the stubs under ``out``; returns the files of jobplane/v1."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    # mypy-protobuf's plugins are console scripts next to this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    package = out / "jobplane" / "v1"
    (package / "__init__.py").write_text(INIT)
    (package / "py.typed").write_text("")
    return sorted(p for p in package.iterdir() if p.is_file())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for path in generate(Path(sys.argv[1])):
        print(path)
