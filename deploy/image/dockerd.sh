#!/usr/bin/env bash
# Starts dockerd in the background unless a daemon already answers (machines here have no systemd).
# Idempotent: CI and developers call it before building the image or running the container tests.
set -euo pipefail
DOCKER=${DOCKER:-/usr/bin/docker}
if "$DOCKER" info >/dev/null 2>&1; then
    exit 0
fi
command -v dockerd >/dev/null || { echo "dockerd.sh: dockerd is not installed (apt-get install docker.io)" >&2; exit 1; }
LOG=${DOCKERD_LOG:-/var/log/tandem-dockerd.log}
setsid nohup dockerd >"$LOG" 2>&1 </dev/null &
for _ in $(seq 60); do
    if "$DOCKER" info >/dev/null 2>&1; then
        echo "dockerd.sh: dockerd ready (log: $LOG)"
        exit 0
    fi
    sleep 1
done
echo "dockerd.sh: dockerd did not answer within 60 s; last lines of $LOG:" >&2
tail -20 "$LOG" >&2
exit 1
