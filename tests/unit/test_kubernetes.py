"""deploy/kubernetes cannot be applied here (no cluster): validate every manifest
against the Kubernetes API's schemas (kubernetes-validate, at pinned versions),
KEDA's objects against the schemas vendored in deploy/kubernetes/schemas, and
check what docs/kubernetes.md promises of them (ADR-0050)."""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from jobplane.cli import build_parser
from jobplane.config import Settings, parse_listen
from jobplane.topology import load_topology
from tests.support.kustomize import (
    DEPLOY,
    ROOT,
    Manifest,
    documents,
    env_file,
    of_kind,
    pod_specs,
    render,
    resource_files,
)

#: The oldest minor Kubernetes still supports upstream, and the newest the
#: package has schemas for: the manifests hold on both.
KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")
BASE = DEPLOY / "base"
HPA = DEPLOY / "hpa"
SECRETS = BASE / "secrets.template.yaml"
SCHEMAS = DEPLOY / "schemas"

# What a process does on SIGTERM before it exits, in seconds beyond its own
# settings (docs/kubernetes.md, "Stopping"): the worker waits up to 10 s for
# the handlers it cancelled after --grace, then writes its last claims,
# outcomes and acks (each group bounded by 10 s; Worker.stop).
WORKER_CANCEL_WAIT = 10.0
WORKER_LAST_WRITES = 10.0
#: Room for the rest of a stop: closing pools and connections.
STOP_MARGIN = 5.0


def _rendered() -> dict[str, list[Manifest]]:
    return {"base": render(BASE), "hpa": render(HPA)}


def _all_objects() -> list[Manifest]:
    objects = [o for group in _rendered().values() for o in group]
    return objects + documents(SECRETS)


def _deployments() -> list[Manifest]:
    return of_kind(render(BASE), "Deployment")


def _containers(pod: Manifest) -> list[Manifest]:
    containers: list[Manifest] = pod["containers"] + pod.get("initContainers", [])
    return containers


def _keda_schema(kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(
        (SCHEMAS / f"{kind.lower()}-keda-v1alpha1.json").read_text()
    )
    return schema


def _validate(manifest: Manifest, version: str) -> None:
    """Raises when ``manifest`` is not valid: KEDA's by its vendored schema,
    everything else by Kubernetes' own (strict: an unknown field is an error)."""
    if manifest["apiVersion"].startswith("keda.sh/"):
        jsonschema.validate(manifest, _keda_schema(manifest["kind"]))
        return
    # No schema for a kind raises too: nothing is skipped unseen.
    kubernetes_validate.validate(manifest, version, strict=True)


# -- Files and schemas --------------------------------------------------------


def test_every_manifest_file_is_rendered_and_every_named_file_exists() -> None:
    used = {p.resolve() for folder in (BASE, HPA) for p in resource_files(folder)}
    assert all(p.is_file() for p in used), sorted(p for p in used if not p.is_file())
    on_disk = {
        p.resolve()
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.suffix in {".yaml", ".env", ".toml"}
    }
    assert on_disk - used == {SECRETS.resolve()}  # applied by hand, never by kustomize


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version: str) -> None:
    objects = _all_objects()
    assert len(objects) > 20
    for manifest in objects:
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            _validate(manifest, version)
        except Exception as exc:  # the failure names the object
            pytest.fail(f"{name} is not valid for Kubernetes {version}: {exc}")


def _identity(manifest: Manifest) -> tuple[str, str, str, str]:
    """Kind, name (a generated one without its hash), namespace and labels."""
    name = manifest["metadata"]["name"]
    if manifest["kind"] == "ConfigMap":
        name = re.sub(r"-[a-z0-9]{10}$", "", name)
    labels = json.dumps(manifest["metadata"].get("labels", {}), sort_keys=True)
    return manifest["kind"], name, manifest["metadata"].get("namespace", ""), labels


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("folder", [BASE, HPA], ids=["base", "hpa"])
def test_the_tests_render_what_kubectl_renders(folder: Path) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(folder)], check=True, capture_output=True, text=True
    ).stdout
    theirs = [o for o in yaml.safe_load_all(out) if o]
    ours = render(folder)
    assert sorted(map(_identity, theirs)) == sorted(map(_identity, ours))
    images = [
        sorted(c["image"] for _, pod in pod_specs(o) for c in _containers(pod))
        for o in (theirs, ours)
    ]
    assert images[0] == images[1]


def test_every_object_lands_in_the_namespace() -> None:
    for group in _rendered().values():
        for manifest in group:
            if manifest["kind"] != "Namespace":
                assert manifest["metadata"]["namespace"] == "jobplane", manifest["metadata"]


def test_validation_fails_on_a_broken_manifest() -> None:
    deployment = copy.deepcopy(_deployments()[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, KUBERNETES_VERSIONS[0])
    scaled = copy.deepcopy(of_kind(render(BASE), "ScaledObject")[0])
    scaled["spec"]["triggers"][0]["metadata"]["value"] = 2  # KEDA takes strings only
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled, KUBERNETES_VERSIONS[0])
    del scaled["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled, KUBERNETES_VERSIONS[0])


def test_the_vendored_keda_schemas_are_schemas() -> None:
    for path in SCHEMAS.glob("*.json"):
        jsonschema.Draft202012Validator.check_schema(json.loads(path.read_text()))


def test_the_yaml_is_lint_clean() -> None:
    config = YamlLintConfig(
        "extends: default\n"
        "rules:\n"
        "  line-length: {max: 120}\n"
        "  document-start: disable\n"
        "  comments: {min-spaces-from-content: 1}\n"
        "  braces: {max-spaces-inside: 1}\n"
    )
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}: {p.desc}"
        for path in sorted(DEPLOY.rglob("*.yaml"))
        for p in linter.run(path.read_text(), config)
    ]
    assert not problems, problems


# -- What every pod promises -----------------------------------------------


def _dockerfile_uid() -> int:
    users = re.findall(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    return int(users[-1])


def _quantity(value: str | int) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}
    text = str(value)
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def test_every_pod_runs_locked_down_as_the_images_user() -> None:
    uid = _dockerfile_uid()
    assert uid > 0
    pods = pod_specs(render(BASE))
    assert {o["kind"] for o, _ in pods} == {"Deployment", "Job"}
    for owner, pod in pods:
        name = owner["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, name
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == uid and context["runAsGroup"] == uid, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in _containers(pod):
            where = f"{name}/{container['name']}"
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"] == {"drop": ["ALL"]}, where
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/tmp" in mounts, where  # tempfile needs a writable directory


def test_every_container_has_requests_within_its_limits() -> None:
    for owner, pod in pod_specs(render(BASE)):
        for container in _containers(pod):
            where = f"{owner['metadata']['name']}/{container['name']}"
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                request = _quantity(resources["requests"][kind])
                limit = _quantity(resources["limits"][kind])
                assert 0 < request <= limit, (where, kind)


def test_every_writable_volume_is_bounded() -> None:
    for owner, pod in pod_specs(render(BASE)):
        for volume in pod["volumes"]:
            if "emptyDir" in volume:
                assert "sizeLimit" in volume["emptyDir"], (owner["metadata"]["name"], volume)


def _args(container: Manifest) -> Any:
    return build_parser().parse_args([str(a) for a in container["args"]])


def test_every_command_parses_and_every_ops_port_is_probed() -> None:
    deployments = _deployments()
    assert {_args(d["spec"]["template"]["spec"]["containers"][0]).command for d in deployments} == {
        "serve",
        "relay",
        "worker",
        "sweep",
    }
    for deployment in deployments:
        template = deployment["spec"]["template"]
        (container,) = template["spec"]["containers"]
        args = _args(container)
        assert callable(args.func)
        listen = parse_listen(args.metrics_listen)
        assert listen is not None and listen.host == "0.0.0.0", container["args"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["ops"] == listen.port
        assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "ops"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ops"}
        assert container["startupProbe"]["httpGet"]["port"] == "ops"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(listen.port)
        assert annotations["prometheus.io/path"] == "/metrics"
    for job in of_kind(render(BASE), "Job"):
        for container in _containers(job["spec"]["template"]["spec"]):
            assert callable(_args(container).func)


def test_the_server_listens_where_its_service_points() -> None:
    (server,) = [d for d in _deployments() if d["metadata"]["name"] == "jobplane-server"]
    (container,) = server["spec"]["template"]["spec"]["containers"]
    config = env_file(BASE / "config.env")
    listen = parse_listen(config["JOBPLANE_LISTEN"])
    ui = parse_listen(_args(container).ui_listen)
    assert listen is not None and ui is not None
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["http-ui"]) == (listen.port, ui.port)


def test_every_service_selects_pods_and_names_their_ports() -> None:
    objects = render(BASE)
    for service in of_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        (deployment,) = [
            d
            for d in of_kind(objects, "Deployment")
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        named = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named


def test_every_deployment_has_a_pdb_that_lets_a_node_drain() -> None:
    objects = render(BASE)
    budgets = of_kind(objects, "PodDisruptionBudget")
    for deployment in of_kind(objects, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        mine = [
            b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(mine) == 1, deployment["metadata"]["name"]
        spec = mine[0]["spec"]
        # One pod may always go, or a drain of its node waits for ever.
        if "maxUnavailable" in spec:
            assert spec["maxUnavailable"] >= 1
        else:
            assert spec["minAvailable"] < deployment["spec"].get("replicas", 1)


def test_every_image_names_one_tag_the_packages_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # The files name the image bare: the kustomization's tag is the one place.
    files = [p for p in resource_files(BASE) if p.suffix == ".yaml"]
    raw = [o for path in files for o in documents(path) if o.get("kind") != "Kustomization"]
    assert {c["image"] for _, pod in pod_specs(raw) for c in _containers(pod)} == {"jobplane"}
    objects = render(BASE)
    images = {c["image"] for _, pod in pod_specs(objects) for c in _containers(pod)}
    assert images == {f"jobplane:{version}"}
    # A Job's pod template cannot change: each release runs a Job of its own,
    # named as a DNS label (its pods' hostname).
    (job,) = of_kind(objects, "Job")
    assert job["metadata"]["name"] == f"jobplane-migrate-{version.replace('.', '-')}"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", job["metadata"]["name"])


def _drain_seconds(args: Any) -> float:
    """How long ``args``' process may take to stop after SIGTERM."""
    from jobplane.server.app import JobplaneServer

    if args.command == "serve":
        grace: float = inspect.signature(JobplaneServer.stop).parameters["grace"].default
        return grace
    if args.command == "worker":
        return float(args.grace) + WORKER_CANCEL_WAIT + WORKER_LAST_WRITES
    return 0.0  # relay and sweep: a batch or pass in flight is rolled back


def test_grace_periods_cover_each_process_drain() -> None:
    for deployment in _deployments():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
        needed = pre_stop.get("seconds", 0) + _drain_seconds(_args(container)) + STOP_MARGIN
        assert pod["terminationGracePeriodSeconds"] >= needed, deployment["metadata"]["name"]


def test_a_serving_pod_leaves_its_endpoints_before_it_stops_serving() -> None:
    (server,) = [d for d in _deployments() if d["metadata"]["name"] == "jobplane-server"]
    (container,) = server["spec"]["template"]["spec"]["containers"]
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] >= 5
    strategy = server["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


# -- Settings, topology, scaling -------------------------------------------


def _runtime_env() -> dict[str, str]:
    (runtime,) = [s for s in documents(SECRETS) if s["metadata"]["name"] == "jobplane-runtime"]
    return {**env_file(BASE / "config.env"), **runtime["stringData"]}


def test_the_settings_load_and_the_topology_is_mounted_where_they_say() -> None:
    env = _runtime_env()
    settings = Settings.from_env(env)  # raises ConfigError on a bad value
    assert settings.topology_path is not None
    for admin in documents(SECRETS):
        Settings.from_env({**env_file(BASE / "config.env"), **admin["stringData"]})
    for owner, pod in pod_specs(render(BASE)):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in _containers(pod):
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "topology"]
            item = volumes["topology"]["configMap"]["items"][0]
            assert Path(mount["mountPath"]) / item["path"] == settings.topology_path, owner
            refs = {
                e.get("configMapRef", e.get("secretRef", {}))["name"] for e in container["envFrom"]
            }
            assert "jobplane-config" in refs, owner
    load_topology(BASE / "topology.toml")


def _queues() -> set[str]:
    return {q.name for q in load_topology(BASE / "topology.toml").queues}


def test_workers_consume_and_scale_on_queues_of_the_topology() -> None:
    queues = _queues()
    (worker,) = [d for d in _deployments() if d["metadata"]["name"] == "jobplane-worker"]
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert set(_args(container).queue) <= queues
    (scaled,) = of_kind(render(BASE), "ScaledObject")
    triggers = {t["type"]: t["metadata"] for t in scaled["spec"]["triggers"]}
    assert triggers["rabbitmq"]["queueName"] in queues
    assert triggers["rabbitmq"]["mode"] == "QueueLength"
    float(triggers["rabbitmq"]["value"])
    assert triggers["rabbitmq"]["vhostName"] == "/"
    query = triggers["prometheus"]["query"]
    assert re.fullmatch(r'max\(jobplane_dispatch_waiting_rows\{queue="([^"]+)"\}\)', query)
    assert re.findall(r'queue="([^"]+)"', query)[0] in queues
    float(triggers["prometheus"]["threshold"])
    (hpa,) = of_kind(render(HPA), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["selector"]["matchLabels"]["queue"] in queues


def test_the_autoscaler_alone_sets_the_workers_replicas() -> None:
    for group in _rendered().values():
        targets = [
            o["spec"]["scaleTargetRef"] for o in group if "scaleTargetRef" in o.get("spec", {})
        ]
        assert len(targets) == 1  # one of KEDA and the HPA, never both
        (deployment,) = [
            d for d in of_kind(group, "Deployment") if d["metadata"]["name"] == targets[0]["name"]
        ]
        assert targets[0]["kind"] == "Deployment"
        # An apply that sets replicas would undo each scaling.
        assert "replicas" not in deployment["spec"]


def test_the_rabbitmq_trigger_reads_the_runtime_url() -> None:
    (auth,) = of_kind(render(BASE), "TriggerAuthentication")
    (scaled,) = of_kind(render(BASE), "ScaledObject")
    (trigger,) = [t for t in scaled["spec"]["triggers"] if t["type"] == "rabbitmq"]
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (ref,) = auth["spec"]["secretTargetRef"]
    assert (ref["parameter"], ref["key"]) == ("host", "JOBPLANE_AMQP_URL")
    assert ref["name"] in {s["metadata"]["name"] for s in documents(SECRETS)}


def test_the_migrate_phase_holds_what_the_job_needs() -> None:
    """``kubectl apply -l jobplane.dev/phase=migrate`` applies the Job with the
    namespace, service account and config maps it names, and nothing else."""
    objects = render(BASE)
    phase = {
        (o["kind"], o["metadata"]["name"])
        for o in objects
        if o["metadata"].get("labels", {}).get("jobplane.dev/phase") == "migrate"
    }
    kinds = sorted(kind for kind, _ in phase)
    assert kinds == ["ConfigMap", "ConfigMap", "Job", "Namespace", "ServiceAccount"]
    (job,) = of_kind(objects, "Job")
    pod = job["spec"]["template"]["spec"]
    assert ("ServiceAccount", pod["serviceAccountName"]) in phase
    commands = [_args(c).command for c in _containers(pod)]
    assert sorted(commands) == ["migrate", "topology"]
    # The migration finishes before the topology is applied: an init container.
    assert _args(pod["initContainers"][0]).command == "migrate"
    for container in _containers(pod):
        secrets = {e["secretRef"]["name"] for e in container["envFrom"] if "secretRef" in e}
        assert secrets == {"jobplane-admin"}
