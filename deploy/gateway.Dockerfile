# Berth gateway: the HTTP API (FastAPI on uvicorn), port 8080.
#
# Build from the repository root (deploy/build-images.sh does this with a
# trimmed context, which also works without BuildKit):
#   docker build --network host -f deploy/gateway.Dockerfile -t berth/gateway:latest .
#
# Both stages start from local images that need no registry
# (deploy/images/build-base.sh): the build stage from berth-python:bookworm
# (python3 + python3-venv), the runtime from berth-base:bookworm (python3).
# Dependencies come from requirements.lock: from the wheels in deploy/wheels/
# when there are any (offline builds), otherwise from the package index,
# trusting the CA bundle the base image copied from the build host.
# Everything above the "gateway only" line is the same in the four service
# Dockerfiles, so building them one after another reuses those layers.
ARG BUILD_IMAGE=berth-python:bookworm
ARG RUNTIME_IMAGE=berth-base:bookworm

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

# ---- gateway only
ENV BERTH_GATEWAY_HOST=0.0.0.0 BERTH_GATEWAY_PORT=8080
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python3", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('BERTH_GATEWAY_PORT', '8080'), timeout=2).status == 200 else 1)"]
CMD ["python3", "-m", "gateway"]
