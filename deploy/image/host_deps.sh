#!/usr/bin/env bash
# What the container tests and `make image` need on the host besides .venv: a Docker CLI with a
# running daemon (a CLI with neither a daemon nor dockerd gets Debian's), mmdebstrap (the image's
# base) and iptables (dockerd's networking). `make test` and `make image` call it. It looks for the tools, not for package names: a Docker that is
# already there (docker-ce, Docker Desktop, a rootless one) is used as it is, never replaced.
# Only what is missing is installed, only as root with apt; anywhere else it says what is
# missing and goes on (exit 0), and the container tests then fail with that message themselves.
# With --strict (make image) it exits 1 instead.
set -euo pipefail
cd "$(dirname "$0")"
strict=0
[[ "${1:-}" == "--strict" ]] && strict=1

missing=()  # Debian packages
# A Docker CLI alone (no daemon answers, no dockerd to start) gets Debian's daemon beside it.
if ! command -v docker >/dev/null || { ! command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; }; then
    missing+=(docker.io)
fi
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
if [[ " ${missing[*]} " == *" docker.io "* ]]; then
    command -v iptables >/dev/null || missing+=(iptables)
fi
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "host_deps.sh: the container tests and make image need ${missing[*]}: install them" \
            "(as root on Debian: apt-get install ${missing[*]}); the other tests run without them" >&2
        exit $strict
    fi
    echo "host_deps.sh: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if docker info >/dev/null 2>&1; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "host_deps.sh: no Docker daemon answers (start one, or join the docker group); the container" \
        "tests will fail until one does" >&2
    exit $strict
fi
DOCKER=$(command -v docker) ./dockerd.sh || exit $strict
