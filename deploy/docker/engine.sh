#!/usr/bin/env bash
# A Docker engine for machines where none runs (no systemd, no iptables): dockerd on a private
# socket, without the default bridge or iptables, on the vfs storage driver. Compose's own
# networks still work, with DNS by service name. Needs root and Debian's docker.io.
#   eval "$(deploy/docker/engine.sh start)"    # prints export DOCKER_HOST=... DOCKER_BUILDKIT=0
#   deploy/docker/engine.sh stop
set -euo pipefail
root=${RLMESH_DOCKER_ROOT:-/var/tmp/rlmesh-docker}
socket="unix://$root/docker.sock"
case "${1:-start}" in
  start)
    if ! command -v dockerd > /dev/null; then
      apt-get update -qq > /dev/null && apt-get install -y -qq docker.io > /dev/null
    fi
    mkdir -p "$root"
    if ! DOCKER_HOST=$socket docker info > /dev/null 2>&1; then
      setsid dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs \
        --data-root "$root/root" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" -H "$socket" \
        > "$root/dockerd.log" 2>&1 < /dev/null &
      for _ in $(seq 60); do
        DOCKER_HOST=$socket docker info > /dev/null 2>&1 && break
        sleep 1
      done
      DOCKER_HOST=$socket docker info > /dev/null 2>&1 || { tail -20 "$root/dockerd.log" >&2; exit 1; }
    fi
    echo "export DOCKER_HOST=$socket"
    # BuildKit runs RUN steps on the default bridge, which this engine has none of: build classic.
    echo "export DOCKER_BUILDKIT=0"
    ;;
  stop)
    if [ -f "$root/dockerd.pid" ]; then
      kill "$(cat "$root/dockerd.pid")" 2> /dev/null || true
      for _ in $(seq 30); do [ -f "$root/dockerd.pid" ] || break; sleep 1; done
    fi
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
