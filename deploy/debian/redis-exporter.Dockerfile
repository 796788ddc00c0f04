# The Redis exporter from Debian's package, for machines that reach Debian's archive but no image registry
# (docker-compose.debian.yml builds it in place of oliver006/redis_exporter:v1.88.0). Debian 12 ships 1.45:
# the metrics the dashboard's Redis row reads have the same names in both.
ARG BASE=debian:12.12-slim
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus-redis-exporter=1.45.* \
    && rm -rf /var/lib/apt/lists/*
USER prometheus
EXPOSE 9121
# Like the official image: the binary is the entrypoint; settings come from REDIS_* environment variables.
ENTRYPOINT ["/usr/bin/prometheus-redis-exporter"]
