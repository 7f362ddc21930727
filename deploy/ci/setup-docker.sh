#!/usr/bin/env bash
# Makes a Docker engine and Berth's local images available; safe to run again.
#
#   deploy/ci/setup-docker.sh
#
# 1. installs docker.io and debootstrap if missing (Debian packages), and
#    what the docker backend confines sandboxes with on this host:
#    slirp4netns, nftables, iproute2 and util-linux (the network of a
#    sandbox with network enabled), e2fsprogs (the workspace quota);
# 2. starts dockerd unless `docker info` already answers, with
#    BERTH_DOCKERD_FLAGS (default: --iptables=false --bridge=none
#    --storage-driver=vfs, which work inside a VM or container without
#    overlayfs or a managed firewall), and waits for it (bounded);
# 3. removes Berth sandbox containers left behind by runs whose data dir is gone;
# 4. builds berth-base:bookworm (sandbox image of the tests) and
#    berth-python:bookworm (build stage of the service images) when missing,
#    and tags berth-base as berth-sandbox:latest (the default
#    BERTH_DOCKER_IMAGE) when that is missing.
# Sandboxes need no Docker network: every container has network mode
# `none`, and one with network enabled gets slirp4netns from the Sandbox
# service (services/sandbox/backends/docker.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
export DEBIAN_FRONTEND=noninteractive
DOCKERD_FLAGS="${BERTH_DOCKERD_FLAGS:---iptables=false --bridge=none --storage-driver=vfs}"
DOCKERD_LOG="${BERTH_DOCKERD_LOG:-/var/log/berth-dockerd.log}"

need=()
# A docker CLI alone (some machines ship one) is not an engine: dockerd is needed.
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v slirp4netns >/dev/null 2>&1 || need+=(slirp4netns)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
command -v mkfs.ext4 >/dev/null 2>&1 || need+=(e2fsprogs)
if ((${#need[@]})); then
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  echo "setup-docker: starting dockerd $DOCKERD_FLAGS"
  # Its own session, so it outlives this script and the shell that ran it.
  # shellcheck disable=SC2086
  setsid nohup dockerd $DOCKERD_FLAGS >>"$DOCKERD_LOG" 2>&1 < /dev/null &
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    echo "setup-docker: dockerd did not come up within 60 s; last log lines:" >&2
    tail -n 30 "$DOCKERD_LOG" >&2 || true
    exit 1
  fi
fi
echo "setup-docker: engine $(docker version --format '{{.Server.Version}}') ready"

# Sandbox containers of earlier runs (tests use throwaway data dirs).
for id in $(docker ps -aq --filter label=berth.managed=1); do
  data_dir="$(docker inspect -f '{{index .Config.Labels "berth.data_dir"}}' "$id" 2>/dev/null || true)"
  if [[ -n "$data_dir" && ! -d "$data_dir" ]]; then
    docker rm -f "$id" >/dev/null 2>&1 || true
  fi
done

bash deploy/images/build-base.sh berth-base:bookworm
BERTH_BASE_PACKAGES=python3-venv bash deploy/images/build-base.sh berth-python:bookworm
# The sandbox service's runtime: what confining sandboxes needs on a node.
BERTH_BASE_PACKAGES="slirp4netns nftables iproute2 e2fsprogs mount" bash deploy/images/build-base.sh berth-node:bookworm
if ! docker image inspect berth-sandbox:latest >/dev/null 2>&1; then
  docker tag berth-base:bookworm berth-sandbox:latest
  echo "setup-docker: tagged berth-base:bookworm as berth-sandbox:latest"
fi

