"""deploy/: the Kubernetes manifests, the Grafana dashboard and the alert rules, checked
offline (no cluster, no network).

* each overlay under deploy/k8s/overlays is built by a small kustomize resolver here
  (resources, JSON6902 patches, namespace, labels, images: only what the manifests use;
  anything else fails loudly), and the result is compared with ``kubectl kustomize``'s
  where kubectl is installed;
* every Kubernetes object validates, strictly, against the API schemas of
  ``kubernetes-validate``; every KEDA object against the vendored KEDA CRDs
  (tests/data/keda), with unknown fields refused;
* what refers to what exists in the same build (ConfigMaps, Secrets and their keys,
  claims, scale targets, selectors, named ports), every TOKENRELAY_* variable is a
  setting and every container's settings load, every command is a real subcommand, and
  each pod gives its process longer than ``drain_s`` to stop;
* each ScaledObject reads exactly its model's Celery queue lists
  (``broker.celery_app.priority_lists``), on Celery's Redis (``TOKENRELAY_CELERY_URL``
  when its worker sets it, else ``TOKENRELAY_REDIS_URL``);
* the dashboard and the alert rules name only metrics (and labels) that web/metrics.py
  exports, besides redis_exporter's.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, get_args
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from app.cli import EXTERNAL_COMMANDS, is_runnable_module
from app.settings import EngineName, Settings
from broker.celery_app import celery_redis_url, priority_lists, queue_name
from tests.stack import REPO

Obj = dict[str, Any]

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KEDA_CRDS = REPO / "tests" / "data" / "keda"
DASHBOARD = DEPLOY / "grafana" / "tokenrelay.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
README = K8S / "README.md"

# Kubernetes versions the manifests must be valid for (kubernetes-validate's schemas).
K8S_VERSIONS = ("1.30", "1.34")
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
WORKLOADS = {"Deployment", "StatefulSet"}
# What the resolver below implements of a kustomization.yaml.
KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "images",
    "patches",
}
SETTING_VARS = {f"TOKENRELAY_{name.upper()}" for name in Settings.model_fields}
HEALTHCHECK = "/usr/local/lib/tokenrelay/healthcheck.py"
# Metrics the alert rules may use that tokenrelay does not export (redis_exporter's).
EXTERNAL_METRICS = {"redis_memory_used_bytes", "redis_memory_max_bytes"}
REQUIRED_ALERTS = {
    "TokenrelayNoWorkerForWaitingRequests",
    "TokenrelayQueueWaitHigh",
    "TokenrelayRedisMemoryHigh",
    "TokenrelayHighErrorRate",
}


# -- a minimal kustomize ------------------------------------------------------------------


def load_docs(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def build(directory: Path) -> list[Obj]:
    """``kustomize build directory`` for the features these manifests use, applied in
    kustomize's order: resources (each directory built first), patches, namespace,
    labels, images."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: this resolver does not implement {sorted(unknown)}"
    objs: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        assert path.exists(), f"{directory}/kustomization.yaml: resource {entry} does not exist"
        objs += build(path) if path.is_dir() else load_docs(path)
    for patch in spec.get("patches", []):
        apply_patch(objs, patch, directory)
    if "namespace" in spec:
        for obj in objs:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = spec["namespace"]
            elif obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for entry in spec.get("labels", []):
        apply_labels(objs, entry)
    for entry in spec.get("images", []):
        set_image(objs, entry)
    return objs


def apply_patch(objs: list[Obj], patch: Obj, directory: Path) -> None:
    """A JSON6902 patch (inline or from a file) on the one object its target names."""
    assert set(patch) <= {"target", "patch", "path"}, patch
    target = patch["target"]
    assert set(target) <= {"kind", "name"}, target
    ops = yaml.safe_load(
        patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    )
    assert isinstance(ops, list), f"{directory}: only JSON6902 patches (a list of operations)"
    matched = [
        o for o in objs if (o["kind"], o["metadata"]["name"]) == (target["kind"], target["name"])
    ]
    assert len(matched) == 1, f"{directory}: patch target {target} matches {len(matched)} objects"
    for op in ops:
        json_patch(matched[0], op)


def json_patch(doc: Obj, op: Obj) -> None:
    """One RFC 6902 operation: add, replace or remove."""
    assert set(op) <= {"op", "path", "value"}, op
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op.get("value"))
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op["op"] == "add":
            node.insert(index, value)
        elif op["op"] == "replace":
            node[index] = value
        else:
            assert op["op"] == "remove", op
            del node[index]
    elif op["op"] == "add":
        node[last] = value
    elif op["op"] == "replace":
        assert last in node, f"replace {op['path']}: no such member"
        node[last] = value
    else:
        assert op["op"] == "remove", op
        del node[last]


def apply_labels(objs: list[Obj], entry: Obj) -> None:
    """``labels:`` without includeSelectors: metadata, and with includeTemplates the pod
    templates and a StatefulSet's volume claim templates."""
    assert set(entry) <= {"pairs", "includeTemplates"}, entry
    for obj in objs:
        obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
        if not entry.get("includeTemplates"):
            continue
        assert obj["kind"] not in {"CronJob", "Job", "DaemonSet", "ReplicaSet"}, obj["kind"]
        if obj["kind"] in WORKLOADS:
            template = obj["spec"]["template"].setdefault("metadata", {})
            template.setdefault("labels", {}).update(entry["pairs"])
        for claim in obj.get("spec", {}).get("volumeClaimTemplates", []):
            claim["metadata"].setdefault("labels", {}).update(entry["pairs"])


def split_image(image: str) -> tuple[str, str | None]:
    assert "@" not in image, image
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, None
    return name, tag


def set_image(objs: list[Obj], entry: Obj) -> None:
    assert set(entry) <= {"name", "newName", "newTag"}, entry
    for _obj, container in containers(objs):
        name, tag = split_image(container["image"])
        if name == entry["name"]:
            tag = entry.get("newTag", tag)
            new = entry.get("newName", name)
            container["image"] = f"{new}:{tag}" if tag else new


# -- walking a build ---------------------------------------------------------------------


def pod_specs(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objs:
        if obj["kind"] in WORKLOADS:
            yield obj, obj["spec"]["template"]["spec"]


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj, spec in pod_specs(objs):
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            yield obj, container


def is_tokenrelay(container: Obj) -> bool:
    return split_image(container["image"])[0] == "tokenrelay"


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} in the build"
    return matches[0]


def template_labels(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj["spec"]["template"]["metadata"]["labels"]
    return labels


def selected(objs: list[Obj], match_labels: dict[str, str]) -> list[Obj]:
    """The workloads whose pods carry every label of ``match_labels``."""
    return [
        obj
        for obj, _spec in pod_specs(objs)
        if match_labels.items() <= template_labels(obj).items()
    ]


def secret_data(objs: list[Obj], name: str) -> dict[str, str]:
    secret = find(objs, "Secret", name)
    data: dict[str, str] = {**secret.get("data", {}), **secret.get("stringData", {})}
    return data


def container_env(objs: list[Obj], container: Obj) -> dict[str, str]:
    """The environment a container starts with (less the image's own ENV): envFrom,
    then env in order, $(VAR) expanded from what is defined before it."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(secret_data(objs, source["secretRef"]["name"]))
    for var in container.get("env", []):
        if "value" in var:
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", var["value"]):
                assert ref in env, f"{var['name']} uses $({ref}) before it is defined"
            env[var["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], var["value"]
            )
            continue
        ref = var["valueFrom"]
        if "secretKeyRef" in ref:
            key = ref["secretKeyRef"]
            data = secret_data(objs, key["name"])
            if key["key"] in data:
                env[var["name"]] = data[key["key"]]
            else:
                assert key.get("optional"), f"{var['name']}: no key {key['key']} in {key['name']}"
        else:
            key = ref["configMapKeyRef"]
            env[var["name"]] = find(objs, "ConfigMap", key["name"])["data"][key["key"]]
    return env


@pytest.fixture(scope="module", params=OVERLAYS, ids=[p.name for p in OVERLAYS])
def built(request: pytest.FixtureRequest) -> list[Obj]:
    """One overlay, built."""
    return build(request.param)


def test_there_are_overlays_for_a_cpu_and_a_gpu_cluster() -> None:
    assert {p.name for p in OVERLAYS} >= {"cpu", "gpu-example"}


def test_every_file_under_deploy_k8s_is_used() -> None:
    used = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        used.add(kustomization)
        used |= {(kustomization.parent / r).resolve() for r in spec.get("resources", [])}
        used |= {
            (kustomization.parent / p["path"]).resolve()
            for p in spec.get("patches", [])
            if "path" in p
        }
    orphans = [p for p in K8S.rglob("*.yaml") if p.resolve() not in used]
    assert not orphans, f"YAML files no kustomization uses: {orphans}"


def test_overlay_builds_into_one_namespace_without_duplicates(built: list[Obj]) -> None:
    keys = Counter((o["apiVersion"].split("/")[0], o["kind"], o["metadata"]["name"]) for o in built)
    assert not [k for k, n in keys.items() if n > 1], "duplicate objects"
    namespace = find(built, "Namespace", "tokenrelay")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in built:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "tokenrelay", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tokenrelay"
    for obj, _spec in pod_specs(built):
        assert template_labels(obj)["app.kubernetes.io/part-of"] == "tokenrelay"
    for _obj, container in containers(built):
        _name, tag = split_image(container["image"])
        assert tag, f"{container['image']}: an image placeholder the overlay did not map"


@pytest.mark.integration  # starts a process
@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_resolver_agrees_with_kubectl_kustomize(overlay: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr

    def key(obj: Obj) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    theirs = sorted((d for d in yaml.safe_load_all(result.stdout) if d), key=key)
    assert sorted(build(overlay), key=key) == theirs


# -- schemas -------------------------------------------------------------------------------


def test_kubernetes_objects_validate_strictly(built: list[Obj]) -> None:
    for obj in built:
        if obj["kind"] in KEDA_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in getattr(exc, "path", []))
                message = getattr(exc, "message", str(exc)[:300])
                pytest.fail(
                    f"{obj['kind']}/{obj['metadata']['name']} ({version}) {path}: {message}"
                )


def strict_crd_schema(node: Any) -> Any:
    """A CRD's openAPIV3Schema as JSON Schema that refuses unknown fields: an object
    that lists its properties (and allows nothing else) gets additionalProperties false;
    x-kubernetes-int-or-string becomes integer-or-string; other x-kubernetes-* go."""
    if isinstance(node, list):
        return [strict_crd_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_crd_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    lists_properties = "properties" in node and "additionalProperties" not in node
    if lists_properties and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    plural = {"ScaledObject": "scaledobjects", "TriggerAuthentication": "triggerauthentications"}
    crd = yaml.safe_load((KEDA_CRDS / f"keda.sh_{plural[kind]}.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = strict_crd_schema(version["schema"]["openAPIV3Schema"])
    validator: jsonschema.protocols.Validator = jsonschema.Draft7Validator(schema)
    return validator


def validate_keda(obj: Obj) -> None:
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    errors = sorted(crd_validator(obj["kind"]).iter_errors(obj), key=lambda e: list(e.path))
    messages = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors]
    assert not messages, f"{obj['kind']}/{obj['metadata']['name']}: {messages}"
    if obj["kind"] == "ScaledObject":
        spec = obj["spec"]  # the CRD's CEL rule
        assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)


def test_keda_objects_validate_against_the_vendored_crds(built: list[Obj]) -> None:
    keda = [o for o in built if o["kind"] in KEDA_KINDS]
    assert {o["kind"] for o in keda} == KEDA_KINDS
    for obj in keda:
        validate_keda(obj)


def test_the_strict_crd_schema_refuses_a_misspelt_field() -> None:
    scaled: Obj = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {
            "scaleTargetRef": {"name": "x"},
            "triggers": [{"type": "redis", "metadata": {"listName": "q"}}],
        },
    }
    validate_keda(scaled)
    scaled["spec"]["cooldownPeriods"] = 300
    with pytest.raises(AssertionError, match="cooldownPeriods"):
        validate_keda(scaled)


def readme_yaml_blocks() -> list[Obj]:
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), flags=re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def test_readme_scaled_object_examples_validate(exported: dict[str, set[str]]) -> None:
    examples = [d for d in readme_yaml_blocks() if d.get("kind") in KEDA_KINDS]
    assert examples, "deploy/k8s/README.md shows a ScaledObject"
    for obj in examples:
        validate_keda(obj)
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                check_promql(trigger["metadata"]["query"], exported, set())


# -- references ----------------------------------------------------------------------------


def test_every_reference_resolves_in_the_build(built: list[Obj]) -> None:
    for obj, spec in pod_specs(built):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["spec"]["selector"]["matchLabels"].items() <= template_labels(obj).items()
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                find(built, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            assert set(volume) - {"name"} <= {
                "persistentVolumeClaim",
                "emptyDir",
                "configMap",
                "secret",
            }
        for container in spec["containers"]:
            container_env(built, container)  # every envFrom and valueFrom resolves
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, f"{where}: {mount}"
            ports = {p["name"] for p in container.get("ports", []) if "name" in p}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = container.get(probe, {})
                for kind in ("httpGet", "tcpSocket"):
                    port = action.get(kind, {}).get("port")
                    assert not isinstance(port, str) or port in ports, f"{where} {probe}: {port}"
        if obj["kind"] == "StatefulSet":
            governing = find(built, "Service", obj["spec"]["serviceName"])
            assert governing["spec"]["clusterIP"] == "None"
    for service in (o for o in built if o["kind"] == "Service"):
        pods = selected(built, service["spec"]["selector"])
        assert pods, f"Service/{service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            names = {
                p.get("name")
                for pod in pods
                for c in pod["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            assert port["targetPort"] in names, service["metadata"]["name"]
    for policy in (o for o in built if o["kind"] == "NetworkPolicy"):
        assert selected(built, policy["spec"]["podSelector"]["matchLabels"])
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                if "namespaceSelector" not in peer and peer["podSelector"]:
                    assert selected(built, peer["podSelector"]["matchLabels"]), policy
    for auth in (o for o in built if o["kind"] == "TriggerAuthentication"):
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in secret_data(built, ref["name"])


def test_autoscalers_own_their_deployments_alone(built: list[Obj]) -> None:
    """An HPA or a ScaledObject per autoscaled Deployment, never both, and no
    ``replicas`` in its manifest (an apply would reset what the autoscaler chose)."""
    owners: Counter[str] = Counter()
    for hpa in (o for o in built if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        owners[target["name"]] += 1
    for scaled in (o for o in built if o["kind"] == "ScaledObject"):
        target = scaled["spec"]["scaleTargetRef"]
        assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment")) == (
            "apps/v1",
            "Deployment",
        )
        owners[target["name"]] += 1
    for name, count in owners.items():
        assert count == 1, f"Deployment/{name} has {count} autoscalers"
        assert "replicas" not in find(built, "Deployment", name)["spec"], name


def test_disruption_budgets_select_one_workload_and_leave_room(built: list[Obj]) -> None:
    budgets = [o for o in built if o["kind"] == "PodDisruptionBudget"]
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h
        for h in built
        if h["kind"] == "HorizontalPodAutoscaler"
    }
    covered = set()
    for pdb in budgets:
        (workload,) = selected(built, pdb["spec"]["selector"]["matchLabels"])
        name = workload["metadata"]["name"]
        covered.add(name)
        if "minAvailable" in pdb["spec"]:  # a node drain must be able to evict one pod
            assert hpas[name]["spec"]["minReplicas"] > pdb["spec"]["minAvailable"], name
        else:
            assert pdb["spec"]["maxUnavailable"] == 1
    workers = {o["metadata"]["name"] for o in built if o["kind"] == "ScaledObject"}
    assert covered >= {"web", "streamer", *workers}


# -- the processes -------------------------------------------------------------------------


def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", REPO / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def web_get_routes() -> set[str]:
    routes = set()
    for path in (REPO / "web").glob("*.py"):
        routes |= set(re.findall(r"\.get\(\"(/[^\"]*)\"\)", path.read_text()))
    return routes


def test_every_command_and_probe_is_real(built: list[Obj]) -> None:
    import flower.urls

    kinds = {"web", "flower", *healthcheck_module().REGISTRIES}
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        text = (REPO / dockerfile).read_text()
        assert f"COPY docker/healthcheck.py {HEALTHCHECK}" in text
    flower_routes = {
        (h[0] if isinstance(h, tuple) else h.regex.pattern).rstrip("$")
        for h in flower.urls.handlers
    }
    for obj, container in containers(built):
        if not is_tokenrelay(container):
            continue
        command = container["command"]
        component = template_labels(obj)["app.kubernetes.io/component"]
        if command[0] == "tokenrelay":
            assert command[1] == component
            assert is_runnable_module(EXTERNAL_COMMANDS[command[1]].module)
        else:  # Flower on the Celery app of broker/flower_app.py, as compose.yaml runs it
            assert command[:4] == ["celery", "-A", "broker.flower_app", "flower"]
            assert component == "flower"
            assert importlib.util.find_spec("broker.flower_app") is not None
        if command[1] == "worker":
            engine = command[command.index("--engine") + 1]
            assert engine in get_args(EngineName)
            assert container_env(built, container)["TOKENRELAY_ENGINE"] == engine
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = container.get(probe)
            if action is None:
                continue
            if "exec" in action:
                assert action["exec"]["command"] == ["python", HEALTHCHECK, component]
                assert component in kinds
            elif component == "web":
                assert action["httpGet"]["path"] in web_get_routes()
            else:
                assert action["httpGet"]["path"] in flower_routes
        if component in {"worker", "streamer", "batcher"}:
            assert "livenessProbe" in container and "readinessProbe" in container
    web = find(built, "Deployment", "web")
    annotations = web["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in web_get_routes()
    assert annotations["prometheus.io/port"] == str(
        web["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    )


def tokenrelay_settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a process with this environment reads (only these TOKENRELAY_*)."""
    with monkeypatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("TOKENRELAY_")]:
            mp.delenv(name)
        for name, value in env.items():
            mp.setenv(name, value)
        return Settings()


def redis_target(built: list[Obj], url: str) -> tuple[str, str]:
    """A ``redis://`` URL naming a Service of the build and one of its ports: the address
    KEDA's operator (another namespace) reaches it at, and the database number."""
    parts = urlsplit(url)
    assert parts.scheme == "redis" and parts.hostname and parts.port, url
    service = find(built, "Service", parts.hostname)
    assert parts.port in {p["port"] for p in service["spec"]["ports"]}, url
    namespace = service["metadata"]["namespace"]
    return f"{parts.hostname}.{namespace}.svc:{parts.port}", parts.path.lstrip("/") or "0"


def test_every_variable_is_a_real_setting_and_every_container_loads_its_settings(
    built: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flower.command import is_flower_envvar

    config = find(built, "ConfigMap", "tokenrelay-config")
    assert set(config["data"]) <= SETTING_VARS, set(config["data"]) - SETTING_VARS
    for obj, container in containers(built):
        if not is_tokenrelay(container):
            continue
        env = container_env(built, container)
        for name in env:
            assert not name.startswith("TOKENRELAY_") or name in SETTING_VARS, name
            assert not name.startswith("FLOWER_") or is_flower_envvar(name), name
        settings = tokenrelay_settings(env, monkeypatch)
        assert settings.redis_url.startswith(
            "redis://:" + secret_data(built, "tokenrelay-secrets")["redis-password"]
        )
        redis_target(built, settings.redis_url)
        redis_target(built, celery_redis_url(settings))  # Celery's: the same by default
        if template_labels(obj)["app.kubernetes.io/component"] == "web":
            assert (settings.host, settings.port) == ("0.0.0.0", 8000)
            assert settings.api_keys, "the web tier requires API keys"


def test_every_pod_outlives_its_drain(built: list[Obj], monkeypatch: pytest.MonkeyPatch) -> None:
    """terminationGracePeriodSeconds > preStop + TOKENRELAY_DRAIN_S + 5 s to close."""
    for obj, spec in pod_specs(built):
        for container in spec["containers"]:
            if not is_tokenrelay(container):
                continue
            drain = tokenrelay_settings(container_env(built, container), monkeypatch).drain_s
            assert drain > 0
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
            sleep = float(pre_stop["command"][1]) if pre_stop else 0.0
            grace = spec["terminationGracePeriodSeconds"]
            assert grace > sleep + drain + 5, f"{obj['metadata']['name']}: {grace} s"


def test_every_pod_meets_the_restricted_pod_security_standard(built: list[Obj]) -> None:
    allowed_volumes = {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
    for obj, spec in pod_specs(built):
        where = obj["metadata"]["name"]
        pod = spec.get("securityContext", {})
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec), where
        assert spec.get("automountServiceAccountToken") is False, where
        for volume in spec.get("volumes", []):
            assert set(volume) - {"name"} <= allowed_volumes, where
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            own = container.get("securityContext", {})
            assert own.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, where
            assert own.get("runAsUser", pod.get("runAsUser")) != 0, where
            seccomp = own.get("seccompProfile", pod.get("seccompProfile", {}))
            assert seccomp.get("type") in {"RuntimeDefault", "Localhost"}, where
            assert own.get("allowPrivilegeEscalation") is False, where
            assert own["capabilities"]["drop"] == ["ALL"], where
            assert not own.get("privileged") and "add" not in own["capabilities"], where


# -- KEDA ----------------------------------------------------------------------------------


def test_each_scaled_object_reads_exactly_its_models_queues(
    built: list[Obj], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = find(built, "ConfigMap", "tokenrelay-config")["data"]
    known = json.loads(config["TOKENRELAY_KNOWN_MODELS"])
    scaled_objects = [o for o in built if o["kind"] == "ScaledObject"]
    assert scaled_objects
    for scaled in scaled_objects:
        spec = scaled["spec"]
        worker = find(built, "Deployment", spec["scaleTargetRef"]["name"])
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        settings = tokenrelay_settings(container_env(built, container), monkeypatch)
        model = container_env(built, container)["TOKENRELAY_SERVED_MODEL_NAME"]
        assert settings.served_name == model
        # Started from zero, the model must be known to the web tier, found at
        # models_dir/<name> (so served under its directory's name), and waited for.
        assert model in known and settings.model == model
        assert float(config["TOKENRELAY_MODEL_WAIT_S"]) > spec["pollingInterval"]
        assert spec["minReplicaCount"] == 0

        expected = [
            *priority_lists(queue_name("interactive", model)),
            *priority_lists(queue_name("batch", model)),
        ]
        triggers = spec["triggers"]
        assert sorted(t["metadata"]["listName"] for t in triggers) == sorted(expected)
        names = [t["name"] for t in triggers]
        assert len(set(names)) == len(names)
        modifiers = spec["advanced"]["scalingModifiers"]
        assert set(re.findall(r"[A-Za-z_]\w*", modifiers["formula"])) == set(names)
        assert float(modifiers["target"]) > 0 and float(modifiers["activationTarget"]) == 0
        # The lists are on Celery's Redis, which the worker's settings name.
        address, db = redis_target(built, celery_redis_url(settings))
        for trigger in triggers:
            assert trigger["type"] == "redis"
            assert trigger["metadata"]["address"] == address
            assert trigger["metadata"]["databaseIndex"] == db
            find(built, "TriggerAuthentication", trigger["authenticationRef"]["name"])


# -- the dashboard and the alerts ------------------------------------------------------------


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name the web tier's /metrics can expose -> its label names: the
    WebMetrics registry with its cluster collector over an empty cluster."""
    from broker.keys import Keys
    from web.metrics import ClusterCollector, WebMetrics

    empty = SimpleNamespace(
        workers=SimpleNamespace(live=list),
        streamers=SimpleNamespace(live=list),
        models=SimpleNamespace(known=list),
        redis=SimpleNamespace(hgetall=lambda _key: {}),  # an empty usage ledger
        keys=Keys(),
    )
    metrics = WebMetrics(ClusterCollector(empty))  # type: ignore[arg-type]
    own = {
        m._name: set(m._labelnames)
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
    }
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        labels = own.get(family.name, set(getattr(family, "_labelnames", None) or ()))
        suffixes = {
            "counter": ["_total"],
            "gauge": [""],
            "histogram": ["_bucket", "_sum", "_count"],
        }
        for suffix in suffixes[family.type]:
            names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    assert "tokenrelay_model_requests_waiting" in names and "tokenrelay_requests_total" in names
    return names


METRIC = re.compile(r"\b(tokenrelay_[a-z0-9_]+|vllm:[a-z0-9_:]+|redis_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")


def check_promql(expr: str, exported: dict[str, set[str]], external: set[str]) -> None:
    """Every metric ``expr`` names is exported (or external), every label it selects on
    is one of that metric's, every grouping label one of its metrics'."""
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    names = METRIC.findall(expr)
    assert names, expr
    for name in names:
        assert name in exported or name in external, f"{name} is not exported: {expr}"
    labels_here = set().union(*(exported.get(n, set()) for n in names))
    for name, body in SELECTOR.findall(expr):
        for label in re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", body):
            assert name in external or label in exported[name], f"{name} has no {label}"
    for group in GROUPING.findall(expr):
        for label in filter(None, (g.strip() for g in group.split(","))):
            assert not labels_here or label in labels_here, f"no metric has {label}: {expr}"


def test_check_promql_refuses_unknown_metrics_and_labels(exported: dict[str, set[str]]) -> None:
    check_promql(
        'sum by (status) (rate(tokenrelay_requests_total{status=~"5.."}[5m]))', exported, set()
    )
    for bad in (
        "tokenrelay_requests",  # a counter's samples end in _total
        'tokenrelay_model_workers{modle="x"}',
        "max by (worker) (tokenrelay_model_workers)",
    ):
        with pytest.raises(AssertionError):
            check_promql(bad, exported, set())


def test_dashboard_panels_query_exported_metrics(exported: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    model_query = variables["model"]["query"]["query"]
    assert model_query == "label_values(tokenrelay_model_workers, model)"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    boxes: list[tuple[int, int, int, int]] = []
    for panel in panels:
        g = panel["gridPos"]
        box = (g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"])
        assert box[2] <= 24
        for other in boxes:
            overlap = (
                box[0] < other[2] and other[0] < box[2] and box[1] < other[3] and other[1] < box[3]
            )
            assert not overlap, panel["title"]
        boxes.append(box)
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            check_promql(target["expr"], exported, set())
    queried = {n for p in panels for t in p.get("targets", []) for n in METRIC.findall(t["expr"])}
    for gauge in ("waiting", "running"):
        assert f"tokenrelay_model_requests_{gauge}" in queried
    assert {"tokenrelay_model_workers", "tokenrelay_model_kv_cache_usage"} <= queried


def test_alert_rules_cover_the_failures_and_query_exported_metrics(
    exported: dict[str, set[str]],
) -> None:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names)
    assert set(names) >= REQUIRED_ALERTS
    for rule in rules:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        external = EXTERNAL_METRICS if rule["alert"] == "TokenrelayRedisMemoryHigh" else set()
        check_promql(rule["expr"], exported, external)
