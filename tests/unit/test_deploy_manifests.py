"""deploy/: the Kubernetes kustomize base validates offline against the Kubernetes schemas
(kubernetes-validate's bundled ones), the CRD and custom-metric parts are checked structurally, the
pieces refer to each other correctly (the router's --backend-dns names the headless Service, ...), and
docker-compose.yml parses with two servers and the router."""

from __future__ import annotations

import argparse
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "kubernetes")
K8S_VERSION = "1.30.0"


def _kustomization() -> dict:
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        return yaml.safe_load(f)


def _docs() -> list[dict]:
    out = []
    for name in _kustomization()["resources"]:
        with open(os.path.join(K8S, name)) as f:
            out.extend(d for d in yaml.safe_load_all(f) if d)
    return out


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def _containers() -> dict[str, dict]:
    return {c["name"]: c for d in _by_kind("Deployment").values() for c in d["spec"]["template"]["spec"]["containers"]}


def test_every_resource_validates_against_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate")
    docs = _docs()
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "ConfigMap",
        "PersistentVolumeClaim",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    } <= kinds
    checked = 0
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD: no bundled schema (checked below)
        kv.validate(d, K8S_VERSION, strict=True)  # raises ValidationError with the path
        checked += 1
    assert checked == len(docs) - 1


def test_schema_validation_catches_a_mistake():
    kv = pytest.importorskip("kubernetes_validate")
    bad = dict(_by_kind("Deployment")["llmserve-server"])
    bad = yaml.safe_load(yaml.safe_dump(bad))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_servers_probes_resources_and_volumes():
    server = _by_kind("Deployment")["llmserve-server"]
    pod = server["spec"]["template"]["spec"]
    c = _containers()["server"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims and claims <= set(_by_kind("PersistentVolumeClaim"))
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["models"] == "/models"
    cms = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
    assert cms <= set(_by_kind("ConfigMap"))
    # the server's settings file holds only flags `llmserve serve` knows
    from llmserve.server.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    known = {a.dest for a in p._actions}
    settings = yaml.safe_load(_by_kind("ConfigMap")["llmserve-config"]["data"]["config.yaml"])
    assert {k.replace("-", "_") for k in settings} <= known
    args = p.parse_args(c["args"][2:])
    assert args.host == "0.0.0.0" and args.port == 8000 and args.config == "/etc/llmserve/config.yaml"


def test_router_discovers_the_servers_through_the_headless_service():
    services = _by_kind("Service")
    server = _by_kind("Deployment")["llmserve-server"]
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    headless = [s for s in services.values() if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1
    h = headless[0]
    assert h["spec"]["selector"].items() <= pod_labels.items()
    assert not h["spec"].get("publishNotReadyAddresses", False)  # only ready pods are in DNS
    router = _containers()["router"]
    from llmserve.router.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(router["args"][2:])
    assert args.backend_dns == [f"{h['metadata']['name']}:{h['spec']['ports'][0]['port']}"]
    assert not args.backends  # no fixed list: replicas scale freely
    assert args.dns_interval <= 10
    rs = services["llmserve-router"]
    assert (
        rs["spec"]["selector"].items()
        <= _by_kind("Deployment")["llmserve-router"]["spec"]["template"]["metadata"]["labels"].items()
    )


def test_hpa_scales_the_servers_on_waiting_requests():
    hpa = _by_kind("HorizontalPodAutoscaler")["llmserve-server"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] in _by_kind("Deployment")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    # prometheus-adapter (values file next to the base) exposes the server gauge under that name
    with open(os.path.join(K8S, "prometheus-adapter-values.yaml")) as f:
        adapter = yaml.safe_load(f)
    rule = adapter["rules"]["custom"][0]
    assert rule["name"]["as"] == name and rule["name"]["matches"] == "llmserve:num_requests_waiting"
    from llmserve.server.metrics import P

    assert P + "num_requests_waiting" == "llmserve:num_requests_waiting"


def test_servicemonitor_is_well_formed_and_selects_the_services():
    (sm,) = _by_kind("ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    (expr,) = sm["spec"]["selector"]["matchExpressions"]
    assert expr["operator"] == "In"
    selected = [s for s in _by_kind("Service").values() if s["metadata"]["labels"].get(expr["key"]) in expr["values"]]
    assert len(selected) == 2
    for ep in sm["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        for s in selected:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}


def test_kustomization_images_and_files():
    k = _kustomization()
    assert k["kind"] == "Kustomization"
    for name in k["resources"]:
        assert os.path.exists(os.path.join(K8S, name)), name
    image_names = {i["name"] for i in k["images"]}
    assert {c["image"] for c in _containers().values()} <= image_names


def test_docker_compose_parses_with_two_servers_and_the_router():
    with open(os.path.join(ROOT, "deploy", "docker-compose.yml")) as f:
        compose = yaml.safe_load(f)
    services = compose["services"]
    servers = [n for n, s in services.items() if "serve" in s.get("command", [])]
    assert len(servers) == 2 and "router" in services
    cmd = services["router"]["command"]
    backends = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--backend"]
    assert backends == [f"http://{n}:8000" for n in servers]
    for n in servers:
        assert services[n]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert "/ready" in " ".join(services[n]["healthcheck"]["test"])


def test_dockerfile_has_cpu_and_cuda_variants():
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
        text = f.read()
    assert "ARG VARIANT=cpu" in text and "whl/cpu" in text and "whl/cu" in text
