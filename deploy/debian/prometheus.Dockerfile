# Prometheus from Debian's package, for machines that reach Debian's archive but no image registry
# (docker-compose.debian.yml builds it in place of prom/prometheus:v3.5.0). Debian 12 ships Prometheus 2.42:
# the scrape config (DNS discovery of every replica) and the dashboard's queries work on both.
ARG BASE=debian:12.12-slim
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus=2.42.* \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /prometheus && chown prometheus:prometheus /prometheus
WORKDIR /prometheus
USER prometheus
EXPOSE 9090
# Like the official image: the binary is the entrypoint, docker-compose.yml's `command` its flags.
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
