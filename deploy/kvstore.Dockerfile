# The shared KV store's image where no registry is reachable (deploy/smoke.sh): Debian's redis-server on
# the same base as deploy/Dockerfile. Elsewhere use a public image (docker.io/library/redis:7.2-alpine,
# valkey/valkey): docker-compose.yml's LLMSERVE_STORE_IMAGE, the kustomization's llmserve-kvstore image.
#   podman build -f deploy/kvstore.Dockerfile --build-arg BASE=localhost/llmserve-base:bookworm -t llmserve-kvstore .
ARG BASE=debian:bookworm-slim
FROM ${BASE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--port", "6379", "--save", "", "--appendonly", "no", "--protected-mode", "no"]
