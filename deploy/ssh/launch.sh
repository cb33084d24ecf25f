#!/usr/bin/env bash
# Start the driver here and one adag agent per host given, over ssh.
#   deploy/ssh/launch.sh ./target/release/my-app DRIVER_ADDR:PORT host1 host2 ...
# The binary must be at the same path on every host. The secret travels on ssh's standard
# input, never on a command line (where `ps` would show it).
set -euo pipefail
app=$1 join=$2; shift 2
secret=${ADAG_TOKEN:-$(head -c 32 /dev/urandom | base64)}
for host in "$@"; do
    # shellcheck disable=SC2029
    printf '%s\n' "$secret" | ssh "$host" \
        "read -r ADAG_TOKEN; export ADAG_TOKEN ADAG_JOIN='$join' ADAG_HOST_NAME='$host'; exec '$app'" &
done
ADAG_TOKEN=$secret exec "$app"
