#!/usr/bin/env bash
# Builds the service images berth/{gateway,session,environment,sandbox}:TAG
# without any image registry.
#
#   deploy/build-images.sh [--wheels] [service ...]
#
#   --wheels   download the wheels of requirements.lock on this host into
#              deploy/wheels/ first, so the image build itself needs no network
#   BERTH_IMAGE_TAG   tag of the images (default latest)
#
# The local bases come first (deploy/images/build-base.sh): berth-base:bookworm
# (runtime) and berth-python:bookworm (build stage, adds python3-venv).
# The build context is a tar of only what the images need, so it is small
# and the legacy builder (no BuildKit/buildx) works as well as BuildKit.
# `--network host` lets the build stage reach the package index on an engine
# without a default bridge network (dockerd --bridge=none); with a filled
# wheelhouse it is not used.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TAG="${BERTH_IMAGE_TAG:-latest}"
WHEELS=0
services=()
for arg in "$@"; do
  case "$arg" in
    --wheels) WHEELS=1 ;;
    gateway|session|environment|sandbox) services+=("$arg") ;;
    *) echo "usage: $0 [--wheels] [gateway|session|environment|sandbox ...]" >&2; exit 2 ;;
  esac
done
((${#services[@]})) || services=(gateway session environment sandbox)

bash deploy/images/build-base.sh berth-base:bookworm
BERTH_BASE_PACKAGES=python3-venv bash deploy/images/build-base.sh berth-python:bookworm
# The sandbox service's runtime: what confining sandboxes needs on a node.
BERTH_BASE_PACKAGES="slirp4netns nftables iproute2 e2fsprogs mount" bash deploy/images/build-base.sh berth-node:bookworm

if ((WHEELS)); then
  # The images run Debian bookworm's CPython 3.11 (glibc 2.36); ask for wheels
  # of exactly that platform, whatever Python runs this script.
  # Older pips do not widen an explicit manylinux tag to the older glibc
  # versions it includes, so name each one.
  arch="$(uname -m)"
  platforms=(--platform "manylinux2014_$arch")
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_$arch"); done
  "${PYTHON:-python3}" -m pip download --quiet --disable-pip-version-check \
    --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
    --dest deploy/wheels -r requirements.lock "setuptools>=69" wheel
  echo "wheelhouse: $(ls deploy/wheels/*.whl | wc -l) wheels in deploy/wheels"
fi

mkdir -p deploy/wheels
context_files=(requirements.lock pyproject.toml README.md protos services gateway deploy/wheels)
for service in "${services[@]}"; do
  echo "building berth/$service:$TAG"
  previous="$(docker image inspect -f '{{.Id}}' "berth/$service:$TAG" 2>/dev/null || true)"
  tar -C "$ROOT" -c --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
      "${context_files[@]}" "deploy/$service.Dockerfile" \
    | docker build --quiet --network host -f "deploy/$service.Dockerfile" -t "berth/$service:$TAG" - >/dev/null
  # The image this one replaced is now untagged; with the vfs storage driver
  # every layer is a full copy, so do not let them pile up.
  if [[ -n "$previous" && "$previous" != "$(docker image inspect -f '{{.Id}}' "berth/$service:$TAG")" ]]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
  fi
done
echo "built: ${services[*]/#/berth/}"
