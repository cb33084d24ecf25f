#!/usr/bin/env bash
# Checks the launch recipes of deploy/: shell scripts with shellcheck, Kubernetes manifests
# against the API's schemas (kubernetes-validate), and the ssh recipe run for real on
# loopback, with a stand-in ssh that runs each host's command here, starting the example
# driver `launched` (ADAG_LISTEN) and two agents (ADAG_JOIN) that must join it.
#   deploy/check.sh [BIN_DIR]   (BIN_DIR: where shellcheck and kubernetes-validate are)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/py-venv/bin}

echo "-- shellcheck"
"$bin/shellcheck" deploy/ssh/launch.sh deploy/slurm/adag.sbatch deploy/check.sh deploy/test/ssh \
    scripts/ray/setup.sh

echo "-- kubernetes-validate"
"$bin/kubernetes-validate" --strict deploy/kubernetes/*.yaml

echo "-- the ssh recipe on loopback"
example=target/release/examples/launched
[ -x "$example" ] || cargo build --release --example launched
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
out=$(mktemp)
# Bounded: a recipe that hangs fails the check instead.
ADAG_SSH="$PWD/deploy/test/ssh" timeout 120 deploy/ssh/launch.sh --listen "127.0.0.1:$port" \
    host-a host-b -- "$example" 2 | tee "$out"
grep -q "2 hosts joined" "$out"
grep -q "host-a" "$out"
grep -q "host-b" "$out"
grep -q "(correct)" "$out"
rm -f "$out"
echo "deploy recipes: ok"
