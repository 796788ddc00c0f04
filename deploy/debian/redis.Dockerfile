# Redis from Debian's package, for machines that reach Debian's archive but no image registry
# (docker-compose.debian.yml builds it in place of redis:7.4.2-alpine). Debian 12 ships Redis 7.0.15: what
# opsd needs (streams, consumer groups, XAUTOCLAIM's deleted-entry list) is in 7.0. The compose file gives the
# command (a password-protected server on /data, maxmemory with noeviction, the append-only file) and runs it
# as the package's `redis` user.
ARG BASE=debian:12.12-slim
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server=5:7.0.* \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--dir", "/data"]
