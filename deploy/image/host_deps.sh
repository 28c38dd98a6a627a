#!/usr/bin/env bash
# What the container tests and `make image` need on the host besides .venv: Docker, mmdebstrap (the
# image's base) and iptables (dockerd's networking), then a running dockerd. `make test` and
# `make image` call it. Idempotent: installed packages and an answering daemon are left alone.
# Installs only as root on a Debian/Ubuntu machine; elsewhere it says what is missing and stops.
set -euo pipefail
cd "$(dirname "$0")"

HOST_PACKAGES=(docker.io mmdebstrap iptables)
missing=()
for package in "${HOST_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "host_deps.sh: the container tests need ${missing[*]}; install them as root" \
            "(apt-get install ${missing[*]}), or skip those tests in a targeted pytest with" \
            "TANDEM_SKIP_CONTAINER_TESTS=1" >&2
        exit 1
    fi
    echo "host_deps.sh: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
./dockerd.sh
