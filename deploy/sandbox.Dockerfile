# Berth sandbox service: sandboxes on the docker backend (gRPC 50053).
#
# Build from the repository root (deploy/build-images.sh does this with a
# trimmed context, which also works without BuildKit):
#   docker build --network host -f deploy/sandbox.Dockerfile -t berth/sandbox:latest .
#
# Both stages start from local images that need no registry
# (deploy/images/build-base.sh): the build stage from berth-python:bookworm
# (python3 + python3-venv), the runtime from berth-base:bookworm (python3).
# Dependencies come from requirements.lock: from the wheels in deploy/wheels/
# when there are any (offline builds), otherwise from the package index,
# trusting the CA bundle the base image copied from the build host.
# Everything above the "sandbox only" line is the same in the four service
# Dockerfiles, so building them one after another reuses those layers.
ARG BUILD_IMAGE=berth-python:bookworm
# The sandbox service runs on berth-node:bookworm: berth-base plus what
# confining sandboxes needs (slirp4netns, nftables, iproute2, e2fsprogs).
ARG RUNTIME_IMAGE=berth-node:bookworm

FROM ${BUILD_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/berth/venv
COPY requirements.lock /src/requirements.lock
# deploy/wheel[s] matches nothing when there is no wheelhouse, and COPY
# needs at least one source: requirements.lock is always there.
COPY requirements.lock deploy/wheel[s] /wheels/
RUN if ls /wheels/*.whl >/dev/null 2>&1; then source="--no-index --find-links /wheels"; else source=""; fi; \
    /opt/berth/venv/bin/pip install $source -r /src/requirements.lock "setuptools>=69" wheel
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY services /src/services
COPY gateway /src/gateway
# The project itself, with its dependencies already pinned above.
RUN /opt/berth/venv/bin/pip install --no-deps --no-build-isolation /src \
 && /opt/berth/venv/bin/pip uninstall -y -q setuptools wheel \
 && /opt/berth/venv/bin/python -c "import services, gateway, berth"

FROM ${RUNTIME_IMAGE}
COPY --from=build /opt/berth/venv /opt/berth/venv
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/berth --create-home berth
ENV PATH=/opt/berth/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BERTH_LOG_JSON=true \
    BERTH_DATA_DIR=/var/lib/berth

# ---- sandbox only
# Runs as root: it drives the Docker engine through /var/run/docker.sock
# (root-equivalent anyway), loop-mounts each sandbox's workspace filesystem
# and attaches slirp4netns to each sandbox's network namespace. Run it with
# --pid=host, SYS_ADMIN, NET_ADMIN and SYS_PTRACE, the loop and tun devices,
# and the data dir mounted rshared at the same path as on the engine's host
# (see deploy/README.md and compose.yaml); without them sandbox creation
# fails closed.
ENV BERTH_SANDBOX_ADDR=0.0.0.0:50053 \
    BERTH_SANDBOX_BACKEND=docker BERTH_DATA_DIR=/var/lib/berth-sandbox
EXPOSE 50053
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python3", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; port = os.environ['BERTH_SANDBOX_ADDR'].rsplit(':', 1)[1]; sys.exit(0 if g.HealthStub(grpc.insecure_channel('127.0.0.1:' + port)).Check(h.HealthCheckRequest(), timeout=2).status == h.HealthCheckResponse.SERVING else 1)"]
CMD ["python3", "-m", "services.sandbox"]
