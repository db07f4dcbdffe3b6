"""Generate the Python stubs (with .pyi types) of proto/ into OUT/jobplane/v1.

Usage: python scripts/protogen.py OUT    (``make proto`` runs it with OUT=core)

The generator is not the dev venv's: protoc's version decides which protobuf
runtimes can load the generated code (gencode 6.30.0 loads on protobuf 6.30.0
and later, 7.x included; ADR-0026), and a grpcio-tools that old needs a
protobuf the dev venv cannot have. So the tools pinned in
scripts/protogen-requirements.txt live in a venv of their own,
``.venv-protogen``, made on first use and made again when the pins change.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PINS = ROOT / "scripts" / "protogen-requirements.txt"
TOOL_VENV = ROOT / ".venv-protogen"
INIT = '"""Generated from proto/jobplane/v1 by `make proto`. Do not edit."""\n'
# Run by the tool venv's interpreter: protoc with its own well-known types.
_PROTOC = (
    "import sys\n"
    "from pathlib import Path\n"
    "from grpc_tools import protoc\n"
    "include = Path(protoc.__file__).parent / '_proto'\n"
    "sys.exit(protoc.main(['grpc_tools.protoc', f'-I{include}', *sys.argv[1:]]))\n"
)


def tool_python() -> Path:
    """The interpreter of the generator's venv, made (or made again) to match the pins."""
    python = TOOL_VENV / "bin" / "python"
    stamp = TOOL_VENV / ".pins-sha256"
    pins = hashlib.sha256(PINS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == pins:
        return python
    # Written last: a venv whose install was cut short is made again whole.
    shutil.rmtree(TOOL_VENV, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(TOOL_VENV)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "-r", str(PINS)],
        check=True,
    )
    stamp.write_text(pins)
    return python


def generate(out: Path) -> list[Path]:
    """Write the stubs under ``out``; returns the files of jobplane/v1."""
    python = tool_python()
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    # mypy-protobuf's plugins are console scripts next to the tools' interpreter.
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    out.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            str(python),
            "-c",
            _PROTOC,
            f"-I{PROTO_ROOT}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"protoc failed with exit code {result.returncode}:\n{result.stderr}")
    package = out / "jobplane" / "v1"
    (package / "__init__.py").write_text(INIT)
    (package / "py.typed").write_text("")
    return sorted(p for p in package.iterdir() if p.is_file())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    for path in generate(Path(sys.argv[1])):
        print(path)
