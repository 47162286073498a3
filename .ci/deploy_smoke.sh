#!/usr/bin/env bash
# .ci/run's deployment smoke (issue #58): deploy/smoke.sh's compose and kube phases, so the deployment
# files (Dockerfile, docker-compose.yml, the kustomize overlays) cannot rot. Where podman cannot run
# here (not root, no apt-get, an install that fails, a host whose runtime refuses containers) it prints
# one line, "deploy smoke skipped: <why>", and exits 0; a phase that fails fails CI.
#
# Installs podman, runc, podman-compose, debootstrap (and curl) with apt-get; podman's settings are the
# project's deploy/podman/containers.conf (CONTAINERS_CONF: the system's file is left alone). kubectl
# (its kustomize renders the overlays) is not in Debian: without it the kube phase is skipped, said in
# one line. Cached between runs on the same machine, outside the clone: the base image and the image's
# layers (podman's storage) and the wheelhouse ($SMOKE_CACHE/whl, refreshed when constraints.txt or
# pyproject.toml change). Ports: the router on $LLMSERVE_PORT (18080). Logs: $SMOKE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
skip() {
  echo "deploy smoke skipped: $*"
  exit 0
}
[ "$(id -u)" = 0 ] || skip "not root (podman's rootful containers and apt-get need root)"
missing=()
for tool in podman runc podman-compose debootstrap curl; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || skip "${missing[*]} missing and no apt-get to install them"
  echo "deploy smoke: apt-get install ${missing[*]}"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc podman-compose debootstrap curl; } \
    >/tmp/llmserve-smoke-apt.log 2>&1 || skip "apt-get install of ${missing[*]} failed (/tmp/llmserve-smoke-apt.log)"
fi
export CONTAINERS_CONF="$PWD/deploy/podman/containers.conf"
podman info >/tmp/llmserve-smoke-podman-info.log 2>&1 || skip "podman info fails here (/tmp/llmserve-smoke-podman-info.log)"
# a container can start here (runc, cgroups, a memory limit): the static catatonit as its whole root
probe=$(mktemp -d)
if cp "$(command -v catatonit || echo /usr/libexec/podman/catatonit)" "$probe/catatonit" 2>/dev/null; then
  podman run --rm --memory 64m --network none --rootfs "$probe" /catatonit --version >/tmp/llmserve-smoke-probe.log 2>&1 ||
    { rm -rf "$probe"; skip "podman cannot start a container here (/tmp/llmserve-smoke-probe.log)"; }
fi
rm -rf "$probe"
export PATH="$PWD/.venv/bin:$PATH" # llmserve (its bench is the load) and pip (the wheelhouse), from make setup
command -v llmserve >/dev/null || skip "no .venv/bin/llmserve (run make setup first)"
phases=compose
if command -v kubectl >/dev/null; then
  phases="compose kube"
else
  echo "deploy smoke: kube phase skipped: kubectl is not installed (its kustomize renders deploy/overlays/podman)"
fi
CACHE="${SMOKE_CACHE:-/var/cache/llmserve-smoke}"
export SMOKE_PHASES="$phases" SMOKE_WHEELS="$CACHE/whl" SMOKE_DIR="${SMOKE_DIR:-$PWD/test-artifacts/deploy-smoke}"
export LLMSERVE_PORT="${LLMSERVE_PORT:-18080}"
echo "deploy smoke: deploy/smoke.sh ($phases; logs in $SMOKE_DIR/smoke.log)"
# a hang fails the run instead of eating CI's 90 minutes: 40 min covers a cold machine (~15 min)
timeout -k 60 2400 deploy/smoke.sh
