# The controller as a container image: slim, non-root, external PostgreSQL and S3.
#
#   docker build -f packaging/controller.Dockerfile -t workfolders-controller .
#   docker run -p 8750:8750 \
#       -e CONTROLLER_DATABASE_URL=postgresql://user:pass@db:5432/controller \
#       -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#       workfolders-controller --storage s3 --s3-bucket B --s3-region R
#
# Arguments after the image name are added to `controller serve` (for TLS:
# --tls-cert /run/secrets/cert.pem --tls-key /run/secrets/key.pem, mounted in).
# The image has no PostgreSQL server: CONTROLLER_DATABASE_URL is required. It
# has the PostgreSQL client tools of major version PG_MAJOR for `controller
# admin backup|restore` (the database half; S3 is backed up by the bucket's
# versioning or replication): pg_dump refuses a server newer than itself, so
# build with --build-arg PG_MAJOR=<the server's major version>. They come from
# the base's Debian when it has that major (bookworm: 15), else from the
# PostgreSQL project's apt repository (the default, 17, is there).
#
# Without a registry (only a Debian mirror and the package index reachable),
# build on a local base made with packaging/controller-base-rootfs.sh and
# PG_MAJOR=15, so nothing but Debian and PyPI is fetched (podman: the docker
# format keeps the HEALTHCHECK, which the OCI format drops; docker finds the
# ignore file beside this file by itself):
#
#   packaging/controller-base-rootfs.sh /tmp/base
#   tar -C /tmp/base -c . | podman import \
#       --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
#       --change 'ENV LANG=C.UTF-8' - localhost/controller-base:bookworm
#   podman build -f packaging/controller.Dockerfile --format docker \
#       --ignorefile packaging/controller.Dockerfile.dockerignore --network host \
#       --build-arg PYTHON_IMAGE=localhost/controller-base:bookworm \
#       --build-arg PG_MAJOR=15 -t workfolders-controller .
#
# tests/test_ops_packaging.py builds and runs it that way, with one more
# option: podman's --volume of the patched pyfuse3 wheel `make deps` built on
# the (bookworm) host into /tmp/wheels, where build.sh below finds and installs
# it instead of compiling the sdist again (minutes on a small machine):
#
#       --volume build/pyfuse3-wheels/W.whl:/tmp/wheels/W.whl:ro
#
# Two stages. The builder compiles what has no wheel for this platform
# (pyfuse3, a required dependency of the package, from its sdist with
# fsagent's patch: gcc, pkg-config and libfuse3-dev) into a virtualenv under
# /opt/controller; the runtime stage copies that virtualenv onto the same
# base image and adds only runtime libraries, so no compiler ships.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
# The interpreter's headers too: a python image has them, Debian's python3
# (a local base, see above) has them in python3-dev.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev pkg-config libfuse3-dev patch \
    && if [ ! -e "$(python -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/controller/venv
ENV PATH=/opt/controller/venv/bin:$PATH
WORKDIR /src
COPY packaging/pyfuse3 ./packaging/pyfuse3
RUN packaging/pyfuse3/build.sh --python /opt/controller/venv/bin/python \
        --wheel-dir /tmp/wheels --install
COPY pyproject.toml README.md ./
COPY common ./common
COPY controller ./controller
COPY fsagent ./fsagent
# The package with its `controller` extra (the base set alone is fsagent's).
RUN pip install --no-cache-dir '.[controller]' \
    && pip check \
    && python -c "import pyfuse3, controller.cli, controller.healthcheck"

FROM ${PYTHON_IMAGE} AS runtime
ARG PG_MAJOR=17
# The client tools from Debian when it has PG_MAJOR; the PostgreSQL project's
# repository is added only when it has not.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libfuse3-3 ca-certificates \
    && if [ -z "$(apt-cache madison "postgresql-client-${PG_MAJOR}")" ]; then \
        apt-get install -y --no-install-recommends postgresql-common \
        && /usr/share/postgresql-common/pgdg/apt.postgresql.org.sh -y; \
    fi \
    && apt-get install -y --no-install-recommends "postgresql-client-${PG_MAJOR}" \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/controller --create-home \
        --shell /usr/sbin/nologin controller
COPY --from=builder /opt/controller/venv /opt/controller/venv
ENV PATH=/opt/controller/venv/bin:$PATH \
    CONTROLLER_DATA_DIR=/var/lib/controller \
    PYTHONUNBUFFERED=1

USER controller
WORKDIR /var/lib/controller
EXPOSE 8750
# Reads serve's command line (PID 1) and asks /readyz over HTTPS when it was
# given --tls-cert, plain HTTP otherwise (controller/healthcheck.py).
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s \
    CMD ["python", "-m", "controller.healthcheck"]
ENTRYPOINT ["controller", "serve", "--listen", "0.0.0.0:8750", "--log-format", "json"]
