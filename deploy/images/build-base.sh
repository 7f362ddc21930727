#!/usr/bin/env bash
# Builds the local base image `berth-base:bookworm` without any image registry:
# a debootstrap minbase root filesystem with python3, imported with
# `docker import`. Sandboxes (BERTH_DOCKER_IMAGE) and the service images
# build FROM it.
#
#   deploy/images/build-base.sh [tag] [mirror]
#
# BERTH_BASE_PACKAGES adds Debian packages (comma or space separated); the
# service images' build stage uses
#   BERTH_BASE_PACKAGES=python3-venv deploy/images/build-base.sh berth-python:bookworm
#
# The host's CA bundle is copied in (BERTH_CA_BUNDLE, default
# /etc/ssl/certs/ca-certificates.crt) so HTTPS through an intercepting proxy
# works inside containers the same way it does on the host.
set -euo pipefail
TAG="${1:-berth-base:bookworm}"
MIRROR="${2:-${BERTH_DEBIAN_MIRROR:-http://deb.debian.org/debian}}"
CA_BUNDLE="${BERTH_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
PACKAGES="python3,ca-certificates"
EXTRA="$(echo "${BERTH_BASE_PACKAGES:-}" | tr ' ' ',' | sed 's/,,*/,/g; s/^,//; s/,$//')"
[[ -n "$EXTRA" ]] && PACKAGES="$PACKAGES,$EXTRA"

if docker image inspect "$TAG" >/dev/null 2>&1 && [[ "${BERTH_REBUILD_BASE:-0}" != "1" ]]; then
  echo "$TAG exists"
  exit 0
fi
command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
ROOTFS="$(mktemp -d /tmp/berth-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
# mktemp makes the directory 0700, and it becomes the image's "/": a
# non-root user in the image could then not even reach /bin.
chmod 0755 "$ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOTFS" "$MIRROR" >/dev/null
if [[ -f "$CA_BUNDLE" ]]; then
  cp "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
fi
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "built $TAG"
