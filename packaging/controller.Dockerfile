# The controller as a container image: slim, non-root, external PostgreSQL and S3.
#
#   docker build -f packaging/controller.Dockerfile -t workfolders-controller .
#   docker run -p 8750:8750 \
#       -e CONTROLLER_DATABASE_URL=postgresql://user:pass@db:5432/controller \
#       -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#       workfolders-controller --storage s3 --s3-bucket B --s3-region R
#
# Arguments after the image name are added to `controller serve`. The image has
# no PostgreSQL server: CONTROLLER_DATABASE_URL is required. It has the
# PostgreSQL client tools for `controller admin backup|restore` (the database
# half; S3 is backed up by the bucket's versioning or replication).
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-client \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/controller --create-home \
        --shell /usr/sbin/nologin controller

WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY controller ./controller
COPY fsagent ./fsagent
RUN pip install --no-cache-dir . && rm -rf /src

USER controller
WORKDIR /var/lib/controller
ENV CONTROLLER_DATA_DIR=/var/lib/controller \
    PYTHONUNBUFFERED=1
EXPOSE 8750
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8750/readyz', timeout=4).status != 200)"]
ENTRYPOINT ["controller", "serve", "--listen", "0.0.0.0:8750", "--log-format", "json"]
