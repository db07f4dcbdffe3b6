"""The Dockerfile cannot be built here (no container engine, no hadolint):
parse it and check what the Kubernetes manifests rely on (ADR-0050) — a build
stage apart, a final stage that installs pinned wheels offline with no
compiler, a numeric non-root user, and an init that passes signals on."""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
#: What a final stage must not install: the build stage compiles, if anything does.
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "python3-dev", "libpq-dev", "git")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction, continuation lines joined,
    comments and the parser directive left out."""
    joined: list[str] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        joined.append(pending + stripped)
        pending = ""
    assert not pending, "a continuation line ends the file"
    found = []
    for line in joined:
        keyword, _, args = line.partition(" ")
        found.append((keyword.upper(), args.strip()))
    return found


def stages(text: str) -> list[Stage]:
    parsed: list[Stage] = []
    for keyword, args in _instructions(text):
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            parsed.append(Stage(words[0], name))
        else:
            assert parsed, f"{keyword} before any FROM"
            parsed[-1].instructions.append((keyword, args))
    return parsed


def _final() -> Stage:
    return stages(DOCKERFILE.read_text())[-1]


def test_the_build_is_multi_stage_and_the_final_stage_starts_clean() -> None:
    parsed = stages(DOCKERFILE.read_text())
    assert len(parsed) >= 2
    names = {s.name for s in parsed[:-1]}
    final = parsed[-1]
    # The final stage is a fresh base image, not the build stage grown on.
    assert final.base not in names
    assert not final.all("COPY") or all("--from=" in c for c in final.all("COPY"))


def test_the_final_stage_runs_as_a_numeric_user_that_is_not_root() -> None:
    users = _final().all("USER")
    assert users, "the final stage sets no USER: it runs as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so runAsNonRoot can check it without a passwd file.
    assert uid.isdigit() and int(uid) > 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) > 0), users[-1]
    # Nothing after USER switches back.
    last = max(i for i, (kw, _) in enumerate(_final().instructions) if kw == "USER")
    assert all(kw != "USER" for kw, _ in _final().instructions[last + 1 :])


def test_the_final_stage_installs_pinned_wheels_offline_without_build_tools() -> None:
    build = stages(DOCKERFILE.read_text())[0]
    wheel = " ".join(a for a in build.all("RUN") if "pip wheel" in a)
    constraint = re.search(r"(?:--constraint|-c)\s+(\S+)", wheel)
    assert constraint, "the build stage's wheels are not pinned"
    assert (ROOT / constraint.group(1)).is_file()
    final_runs = " ".join(_final().all("RUN"))
    install = [a for a in _final().all("RUN") if "pip install" in a]
    assert install and all("--no-index" in a for a in install), install
    assert f"from={build.name}" in " ".join(install)  # the wheels come from the build stage
    words = set(re.split(r"[\s;&|]+", final_runs))
    assert not words & set(BUILD_TOOLS), words & set(BUILD_TOOLS)


def test_an_init_passes_signals_to_jobplane() -> None:
    (entrypoint,) = _final().all("ENTRYPOINT")
    argv = yaml.safe_load(entrypoint)  # the exec form is a JSON array
    assert isinstance(argv, list), "the shell form would put sh, not jobplane, under the signal"
    assert argv[0] == "tini" and argv[-1] == "jobplane", argv


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name in (".git", ".venv", "tests"):
        assert _ignored(name, patterns), f"{name} is sent to the builder"
    for stage in stages(DOCKERFILE.read_text()):
        for copy in stage.all("COPY"):
            words = [w for w in shlex.split(copy) if not w.startswith("--")]
            if any(a.startswith("--from=") for a in shlex.split(copy)):
                continue
            for source in words[:-1]:
                assert (ROOT / source).exists(), source
                assert not _ignored(source, patterns), f"{source} is copied but ignored"


def test_compose_builds_this_image_for_every_jobplane_process() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    built = {n: s for n, s in services.items() if s.get("image") == "jobplane:dev"}
    assert built
    for name, service in built.items():
        assert service.get("build") == ".", name
        # The image's ENTRYPOINT is jobplane: compose gives its arguments only.
        assert service["command"][0] != "jobplane", name
