#!/usr/bin/env bash
# A Docker engine for machines where none runs (no systemd, no iptables): dockerd on a private
# socket, without the default bridge or iptables, on overlay2 where the kernel offers it and vfs
# (which stores every layer whole) where it does not. Compose's own networks still work, with DNS
# by service name. Needs root and Debian's docker.io.
#   eval "$(deploy/docker/engine.sh start)"    # prints export DOCKER_HOST=... DOCKER_BUILDKIT=0
#   deploy/docker/engine.sh stop
set -euo pipefail
root=${RLMESH_DOCKER_ROOT:-/var/tmp/rlmesh-docker}
socket="unix://$root/docker.sock"

answers() {
  DOCKER_HOST=$socket docker info > /dev/null 2>&1
}

start_with() {
  setsid dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver="$1" \
    --data-root "$root/root-$1" --exec-root "$root/exec" --pidfile "$root/dockerd.pid" -H "$socket" \
    > "$root/dockerd.log" 2>&1 < /dev/null &
  for _ in $(seq 60); do
    answers && return 0
    kill -0 $! 2> /dev/null || return 1
    sleep 1
  done
  return 1
}

case "${1:-start}" in
  start)
    if ! command -v dockerd > /dev/null; then
      apt-get update -qq > /dev/null && apt-get install -y -qq docker.io > /dev/null
    fi
    mkdir -p "$root"
    if ! answers; then
      if ! { grep -qw overlay /proc/filesystems && start_with overlay2; }; then
        [ -f "$root/dockerd.pid" ] && kill "$(cat "$root/dockerd.pid")" 2> /dev/null && sleep 2
        start_with vfs || { tail -20 "$root/dockerd.log" >&2; exit 1; }
      fi
      # Whoever started it stops it; an engine that was already running is left alone.
      echo "export RLMESH_DOCKER_STARTED=1"
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
