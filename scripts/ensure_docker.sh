#!/usr/bin/env bash
# Make a Docker daemon answer: reuse a running one (local socket or DOCKER_HOST), else, as root on Debian,
# install docker.io and start dockerd in the background. Anywhere else, say exactly what is missing.
set -euo pipefail

if docker info >/dev/null 2>&1; then exit 0; fi
if [ -n "${DOCKER_HOST:-}" ]; then
  echo "ensure_docker: DOCKER_HOST=$DOCKER_HOST is set but 'docker info' fails there; start that daemon" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "ensure_docker: no Docker daemon answers and I can only install one as root on Debian." >&2
  echo "  Install Docker Engine (https://docs.docker.com/engine/install/) and start it, or set DOCKER_HOST." >&2
  exit 1
fi
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  echo "ensure_docker: installing docker.io and debootstrap from Debian" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
if ! pgrep -x dockerd >/dev/null; then
  echo "ensure_docker: starting dockerd (log: /var/log/t1-dockerd.log)" >&2
  nohup dockerd >/var/log/t1-dockerd.log 2>&1 &
fi
for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then exit 0; fi
  sleep 1
done
echo "ensure_docker: dockerd did not answer within 60 s; last log lines:" >&2
tail -n 20 /var/log/t1-dockerd.log >&2 || true
exit 1
