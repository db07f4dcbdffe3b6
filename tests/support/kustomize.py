"""What ``kubectl kustomize`` makes of deploy/kubernetes, for tests without kubectl.

Only the parts of kustomize the manifests use: ``resources`` (files, and
folders with a kustomization of their own), ``namespace``, ``labels``,
``images``, ``configMapGenerator`` (without the hash suffix, which only
renames) and ``patches`` that delete an object (``$patch: delete``). Anything
else in a kustomization fails :func:`render`, so a manifest never relies on
something these tests do not see.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"

Manifest = dict[str, Any]

_UNDERSTOOD = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "images",
    "generatorOptions",
    "configMapGenerator",
    "patches",
}


def documents(path: Path) -> list[Manifest]:
    """The YAML documents of ``path``, empty ones left out."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(folder: Path) -> Manifest:
    data: Manifest = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(data) - _UNDERSTOOD
    assert not unknown, f"{folder}: kustomization fields these tests do not render: {unknown}"
    return data


def resource_files(folder: Path) -> list[Path]:
    """Every file a kustomization in ``folder`` (and the folders it names) reads."""
    data = kustomization(folder)
    files = [folder / "kustomization.yaml"]
    for entry in data.get("resources", []):
        target = (folder / entry).resolve()
        files += resource_files(target) if target.is_dir() else [target]
    for generator in data.get("configMapGenerator", []):
        files += [folder / _source(f) for f in generator.get("files", [])]
        files += [folder / e for e in generator.get("envs", [])]
    return files


def _source(entry: str) -> str:
    """A generator's ``files`` entry, ``key=path`` or ``path``: the path."""
    return entry.split("=", 1)[-1]


def env_file(path: Path) -> dict[str, str]:
    """A kustomize ``envs`` file: KEY=VALUE lines; blank lines and # comments skipped."""
    pairs: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value
    return pairs


def _config_maps(folder: Path, data: Manifest) -> list[Manifest]:
    labels = (data.get("generatorOptions") or {}).get("labels", {})
    made = []
    for generator in data.get("configMapGenerator", []):
        values: dict[str, str] = {}
        for entry in generator.get("files", []):
            key, _, path = entry.rpartition("=")
            values[key or Path(path).name] = (folder / path).read_text()
        for env in generator.get("envs", []):
            values.update(env_file(folder / env))
        made.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"], "labels": dict(labels)},
                "data": values,
            }
        )
    return made


def _deleted(data: Manifest) -> set[tuple[str, str]]:
    gone = set()
    for patch in data.get("patches", []):
        body = yaml.safe_load(patch["patch"])
        assert body.get("$patch") == "delete", f"only delete patches are rendered: {body}"
        gone.add((body["kind"], body["metadata"]["name"]))
    return gone


def _pod_specs(manifest: Manifest) -> list[Manifest]:
    spec = manifest.get("spec") or {}
    template = spec.get("template") or {}
    return [template["spec"]] if "spec" in template else []


def _with_images(manifest: Manifest, images: list[Manifest]) -> None:
    for pod in _pod_specs(manifest):
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            for image in images:
                if container["image"].split(":")[0] == image["name"]:
                    name = image.get("newName", image["name"])
                    container["image"] = f"{name}:{image['newTag']}"


def render(folder: Path) -> list[Manifest]:
    """The objects ``kubectl kustomize folder`` outputs (generated names without their hash)."""
    data = kustomization(folder)
    objects: list[Manifest] = []
    for entry in data.get("resources", []):
        target = (folder / entry).resolve()
        objects += render(target) if target.is_dir() else documents(target)
    objects += _config_maps(folder, data)
    gone = _deleted(data)
    missing = gone - {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not missing, f"{folder}: patches delete objects that are not there: {missing}"
    objects = [o for o in objects if (o["kind"], o["metadata"]["name"]) not in gone]
    rendered = []
    for original in objects:
        manifest = copy.deepcopy(original)
        metadata = manifest["metadata"]
        if "namespace" in data and manifest["kind"] != "Namespace":
            metadata["namespace"] = data["namespace"]
        for group in data.get("labels", []):
            metadata.setdefault("labels", {}).update(group["pairs"])
        _with_images(manifest, data.get("images", []))
        rendered.append(manifest)
    return rendered


def pod_specs(objects: list[Manifest]) -> list[tuple[Manifest, Manifest]]:
    """(owner, pod spec) of every Deployment and Job."""
    return [(o, pod) for o in objects for pod in _pod_specs(o)]


def of_kind(objects: list[Manifest], kind: str) -> list[Manifest]:
    return [o for o in objects if o["kind"] == kind]
