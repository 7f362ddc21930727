#!/usr/bin/env bash
# Builds the four service images, runs them as containers, runs
# deploy/ci/smoke.py against the containerized gateway, and tears everything
# down again (also on failure, after printing each container's log tail).
#
#   deploy/ci/containers-smoke.sh
#
#   BERTH_SMOKE_NETWORK  bridge (default): a user-defined network
#                        `berth-smoke`, services found by name, the gateway
#                        published on 127.0.0.1:$BERTH_SMOKE_PORT, one SQLite
#                        database per service in its own volume.
#                        host: every container on the host network (ports
#                        BERTH_SMOKE_PORT and 15051-15053 on loopback) and
#                        PostgreSQL at BERTH_SMOKE_POSTGRES (default the
#                        host's postgresql://postgres@127.0.0.1:5432), one
#                        database per service.
#   BERTH_SMOKE_PORT     gateway port on the host (default 18080)
#   BERTH_SMOKE_WHEELS=1 build the images from a wheelhouse downloaded on
#                        the host (no network inside the image build)
#   BERTH_SMOKE_KEEP=1   leave the stack running for inspection
#   BERTH_SMOKE_PREBUILT=1 use berth/*:latest as they are (built already,
#                        e.g. by .ci/run while the suite ran)
#
# Needs a running engine (deploy/ci/setup-docker.sh) and python3 with httpx
# for the smoke script (the project's .venv is used when present).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
MODE="${BERTH_SMOKE_NETWORK:-bridge}"
PORT="${BERTH_SMOKE_PORT:-18080}"
NET=berth-smoke
PREFIX=berth-smoke
# The sandbox service starts sandbox containers with bind mounts of its data
# dir, which the engine resolves on the host: same path inside and out.
DATA="${BERTH_SMOKE_DATA_DIR:-/var/tmp/berth-smoke}"
SANDBOX_IMAGE="${BERTH_SMOKE_SANDBOX_IMAGE:-berth-base:bookworm}"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY=python3
SERVICES=(sandbox environment session gateway)

log() { echo "containers-smoke: $*"; }

# The data dir as a shared mount of its own, so mounts the sandbox service
# makes below it (rshared) reach the host, where the engine resolves binds.
share_data() {
  mkdir -p "$DATA"
  if ! mountpoint -q "$DATA"; then mount --bind "$DATA" "$DATA"; fi
  mount --make-rshared "$DATA"
}

unshare_data() {
  # Deepest first: the workspaces, then the data dir's own bind mount.
  awk -v d="$DATA" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/self/mounts | sort -r \
    | while read -r m; do umount -l "$m" 2>/dev/null || true; done
}

teardown() {
  local status=$?
  if ((status != 0)); then
    for s in "${SERVICES[@]}"; do
      if docker inspect "$PREFIX-$s" >/dev/null 2>&1; then
        echo "----- $PREFIX-$s ($(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$PREFIX-$s"))"
        docker logs --tail 40 "$PREFIX-$s" 2>&1 | cut -c1-400
      fi
    done
  fi
  if [[ "${BERTH_SMOKE_KEEP:-0}" == "1" ]]; then
    log "BERTH_SMOKE_KEEP=1: leaving the stack running"
    return
  fi
  for s in "${SERVICES[@]}"; do docker rm -f "$PREFIX-$s" >/dev/null 2>&1 || true; done
  docker ps -aq --filter "label=berth.data_dir=$DATA" | xargs -r docker rm -f >/dev/null 2>&1 || true
  for s in "${SERVICES[@]}"; do docker volume rm "$PREFIX-$s" >/dev/null 2>&1 || true; done
  docker network rm "$NET" >/dev/null 2>&1 || true
  unshare_data
  rm -rf "$DATA"
  if [[ "$MODE" == "host" ]]; then drop_databases; fi
  exit "$status"
}

PG="${BERTH_SMOKE_POSTGRES:-postgresql://postgres@127.0.0.1:5432}"
drop_databases() {
  for s in "${SERVICES[@]}"; do psql -q "$PG/postgres" -c "DROP DATABASE IF EXISTS berth_smoke_$s" >/dev/null 2>&1 || true; done
}

if [[ "${BERTH_SMOKE_PREBUILT:-0}" == "1" ]]; then
  log "using the images built before (BERTH_SMOKE_PREBUILT=1)"
else
  log "building images"
  if [[ "${BERTH_SMOKE_WHEELS:-0}" == "1" ]]; then
    bash deploy/build-images.sh --wheels
  else
    bash deploy/build-images.sh
  fi
fi

trap teardown EXIT
for s in "${SERVICES[@]}"; do docker rm -f "$PREFIX-$s" >/dev/null 2>&1 || true; done
unshare_data
rm -rf "$DATA"
mkdir -p "$DATA"

# One internal token for every container, as a deployment has; passed by
# name (-e VAR), so its value never appears on a command line.
BERTH_INTERNAL_TOKEN="$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')"
export BERTH_INTERNAL_TOKEN
common=(--detach --restart no --label berth.smoke=1 -e BERTH_LOG_LEVEL=INFO -e BERTH_INTERNAL_TOKEN)
declare -A addr db listen
if [[ "$MODE" == "host" ]]; then
  drop_databases
  for s in "${SERVICES[@]}"; do
    psql -q "$PG/postgres" -c "CREATE DATABASE berth_smoke_$s" >/dev/null
    db[$s]="$PG/berth_smoke_$s"
  done
  addr=([session]=127.0.0.1:15051 [environment]=127.0.0.1:15052 [sandbox]=127.0.0.1:15053)
  net=(--network host)
  listen=([session]=127.0.0.1:15051 [environment]=127.0.0.1:15052 [sandbox]=127.0.0.1:15053)
  gateway_net=(-e BERTH_GATEWAY_HOST=127.0.0.1 -e "BERTH_GATEWAY_PORT=$PORT")
else
  docker network inspect "$NET" >/dev/null 2>&1 || docker network create "$NET" >/dev/null
  for s in session environment gateway; do db[$s]="sqlite:////var/lib/berth/$s.db"; done
  db[sandbox]="sqlite:///$DATA/sandbox.db"
  addr=([session]=session:50051 [environment]=environment:50052 [sandbox]=sandbox:50053)
  net=(--network "$NET")
  listen=([session]=0.0.0.0:50051 [environment]=0.0.0.0:50052 [sandbox]=0.0.0.0:50053)
  gateway_net=(-p "127.0.0.1:$PORT:8080")
fi

volume() { [[ "$MODE" == "host" ]] || echo "-v $PREFIX-$1:/var/lib/berth"; }
named() { [[ "$MODE" == "host" ]] || echo "--network-alias $1"; }

log "starting containers ($MODE network)"
# shellcheck disable=SC2046
share_data
sandbox_node_privileges=(
  --cap-add SYS_ADMIN --cap-add NET_ADMIN --cap-add SYS_PTRACE -v /dev:/dev
  --device-cgroup-rule 'b 7:* rwm' --device-cgroup-rule 'c 10:237 rwm' --device-cgroup-rule 'c 10:200 rwm'
)
# In the host's PID namespace with the capabilities and devices confining
# sandboxes needs (deploy/README.md), and the data dir propagating back to the
# host: it loop-mounts each workspace there (the engine binds them from the
# host) and attaches slirp4netns to each sandbox's network namespace.
docker run "${common[@]}" "${net[@]}" --name "$PREFIX-sandbox" $(named sandbox) \
  --pid=host "${sandbox_node_privileges[@]}" \
  -v /var/run/docker.sock:/var/run/docker.sock -v "$DATA:$DATA:rshared" \
  -e "BERTH_DATA_DIR=$DATA" -e "BERTH_DOCKER_IMAGE=$SANDBOX_IMAGE" \
  -e "BERTH_SANDBOX_ADDR=${listen[sandbox]}" -e "BERTH_SANDBOX_DATABASE_URL=${db[sandbox]}" \
  berth/sandbox:latest >/dev/null
# shellcheck disable=SC2046
docker run "${common[@]}" "${net[@]}" --name "$PREFIX-environment" $(named environment) $(volume environment) \
  -e "BERTH_ENVIRONMENT_ADDR=${listen[environment]}" -e "BERTH_SANDBOX_ADDR=${addr[sandbox]}" \
  -e "BERTH_ENVIRONMENT_DATABASE_URL=${db[environment]}" \
  berth/environment:latest >/dev/null
# shellcheck disable=SC2046
docker run "${common[@]}" "${net[@]}" --name "$PREFIX-session" $(named session) $(volume session) \
  -e "BERTH_SESSION_ADDR=${listen[session]}" -e "BERTH_ENVIRONMENT_ADDR=${addr[environment]}" \
  -e "BERTH_SESSION_DATABASE_URL=${db[session]}" \
  berth/session:latest >/dev/null
# shellcheck disable=SC2046
docker run "${common[@]}" "${net[@]}" "${gateway_net[@]}" --name "$PREFIX-gateway" $(named gateway) $(volume gateway) \
  -e "BERTH_SESSION_ADDR=${addr[session]}" -e "BERTH_ENVIRONMENT_ADDR=${addr[environment]}" \
  -e "BERTH_GATEWAY_DATABASE_URL=${db[gateway]}" \
  berth/gateway:latest >/dev/null

log "waiting for health checks"
for s in "${SERVICES[@]}"; do
  for _ in $(seq 1 90); do
    state="$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$PREFIX-$s")"
    [[ "$state" == running/healthy || "$state" != running/* ]] && break
    sleep 1
  done
  log "$s: $state"
  [[ "$state" == running/healthy ]] || { log "$s is not healthy"; exit 1; }
done

log "creating an API key"
key="$(docker exec "$PREFIX-gateway" berth keys create --org smoke --scopes tasks:read tasks:write \
  | "$PY" -c 'import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["key"])')"

log "running deploy/ci/smoke.py"
"$PY" deploy/ci/smoke.py --base-url "http://127.0.0.1:$PORT" --api-key "$key"
