# The images of the four services: one dependency stage they share, then a small target each.
# Build from the repository root after `make wheels` (pip installs offline from ./wheels, so the
# build needs no network when the base image has the shared libraries below):
#   docker build --target manager -t rlmesh-manager .       (or: docker compose build)
# BASE_IMAGE: a Debian or Ubuntu image with Python 3.11 (default python:3.11-slim). Without an
# image registry, deploy/docker/base-image.sh builds one from Debian packages.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS system
# The Mooncake transfer engine links libibverbs, libnuma and libcurl even on machines without
# RDMA. A base that lacks them gets them from its distribution (the one step that then needs a
# mirror).
RUN if ! { ldconfig -p | grep -q libnuma.so.1 && ldconfig -p | grep -q libibverbs.so.1 \
           && ldconfig -p | grep -q libcurl.so.4; }; then \
        apt-get update && apt-get install -y --no-install-recommends libnuma1 libibverbs1 libcurl4 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV PATH=/opt/rlmesh/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1

# The sources alone, in as few layers as an image of its own: each stage below copies them in one
# step (the vfs storage driver stores every layer whole).
FROM scratch AS sources
COPY pyproject.toml /app/
COPY protos /app/protos
COPY rlmesh /app/rlmesh
COPY services /app/services
COPY rlmesh_verifiers /app/rlmesh_verifiers

# The wheelhouse (with the requirements `make wheels` copied into it) stays in this stage: only the
# virtualenv it fills reaches the images.
FROM system AS dependencies
COPY wheels /wheels
RUN python3 -m venv /opt/rlmesh \
    && pip install --no-cache-dir --no-index --find-links /wheels "setuptools>=68" -r /wheels/requirements.txt

FROM system AS app
COPY --from=dependencies /opt/rlmesh /opt/rlmesh
COPY --from=sources /app /app
WORKDIR /app
RUN python -m rlmesh.protogen && pip install --no-cache-dir --no-index --no-deps --no-build-isolation -e . \
    && python -c "import torch, grpc, mooncake.engine, rlmesh.manager.v1.manager_pb2"
# Each target below is one ENV step (every step costs a whole copy of the image under vfs): the
# service it runs, which listens on every interface at its gRPC port, /metrics at that port + 1000.
# Health checks are the deployment's (compose, Kubernetes probes): `rlmesh health 127.0.0.1:PORT`.
CMD ["sh", "-c", "exec rlmesh \"$RLMESH_SERVICE\""]

FROM app AS manager
ENV RLMESH_SERVICE=manager \
    RLMESH_MANAGER_SERVER__HOST=0.0.0.0 RLMESH_MANAGER_SERVER__PORT=50151 RLMESH_MANAGER_SERVER__METRICS_PORT=51151

FROM app AS weights
ENV RLMESH_SERVICE=weights \
    RLMESH_WEIGHTS_SERVER__HOST=0.0.0.0 RLMESH_WEIGHTS_SERVER__PORT=50152 RLMESH_WEIGHTS_SERVER__METRICS_PORT=51152

FROM app AS trainer
ENV RLMESH_SERVICE=trainer \
    RLMESH_TRAINER_SERVER__HOST=0.0.0.0 RLMESH_TRAINER_SERVER__PORT=50153 RLMESH_TRAINER_SERVER__METRICS_PORT=51153

FROM app AS rollout
ENV RLMESH_SERVICE=rollout \
    RLMESH_ROLLOUT_SERVER__HOST=0.0.0.0 RLMESH_ROLLOUT_SERVER__PORT=50161 RLMESH_ROLLOUT_SERVER__METRICS_PORT=51161

# The rollout instance on vLLM's CUDA build (GPU hosts): its own virtualenv, since vLLM pins its
# own torch and transformers. Fill the wheelhouse on a GPU host with `make wheels-vllm-cuda`.
FROM system AS vllm-dependencies
COPY wheels /wheels
RUN python3 -m venv /opt/rlmesh \
    && pip install --no-cache-dir --no-index --find-links /wheels "setuptools>=68" -r /wheels/requirements-vllm-cuda.txt

FROM system AS rollout-vllm
COPY --from=vllm-dependencies /opt/rlmesh /opt/rlmesh
COPY --from=sources /app /app
# The contracts' generated code comes from the main image: this virtualenv has no protoc.
COPY --from=app /app/gen /app/gen
WORKDIR /app
RUN pip install --no-cache-dir --no-index --no-deps --no-build-isolation -e .
ENV RLMESH_SERVICE=rollout \
    RLMESH_ROLLOUT_SERVER__HOST=0.0.0.0 RLMESH_ROLLOUT_SERVER__PORT=50161 RLMESH_ROLLOUT_SERVER__METRICS_PORT=51161 \
    RLMESH_ROLLOUT_ENGINE__KIND=vllm
CMD ["sh", "-c", "exec rlmesh \"$RLMESH_SERVICE\""]
