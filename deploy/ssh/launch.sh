#!/usr/bin/env bash
# Start one adag agent per host over ssh, then the driver here.
#
#   deploy/ssh/launch.sh --listen IP:PORT [--agent COMMAND] HOST... -- DRIVER_COMMAND [ARG...]
#
#   --listen IP:PORT  where the driver listens (an address of this machine the hosts reach);
#                     given to the driver as ADAG_LISTEN and to each agent as ADAG_JOIN.
#   --agent COMMAND   what each host runs as its agent (default: the driver's program, by its
#                     absolute path: a Rust binary linked with adag becomes an agent when
#                     ADAG_JOIN is set). For Python: --agent "/opt/venv/bin/python -m adag.agent".
#   HOST...           ssh destinations (user@host, or names from ~/.ssh/config).
#
# The secret (ADAG_TOKEN, else a fresh one) reaches each host on ssh's standard input, never
# on a command line (where `ps` shows it). Agents start first and keep trying to join for
# ADAG_JOIN_TIMEOUT seconds (default here 120), so the order of starts does not matter. The
# agents leave when the driver exits; this script then returns the driver's exit status.
# ADAG_SSH names the ssh program (default: ssh).
set -euo pipefail

usage() {
    sed -n '2,10p' "$0" >&2
    exit 2
}

listen="" agent="" hosts=()
while [ $# -gt 0 ]; do
    case $1 in
        --listen) listen=${2:?--listen needs IP:PORT}; shift 2 ;;
        --agent) agent=${2:?--agent needs a command}; shift 2 ;;
        --) shift; break ;;
        -*) usage ;;
        *) hosts+=("$1"); shift ;;
    esac
done
[ -n "$listen" ] && [ $# -gt 0 ] || usage

# The same path must mean the same program on every host: make the driver's absolute.
driver_program=$1
if [[ $driver_program == */* ]]; then
    driver_program=$(cd "$(dirname "$driver_program")" && pwd)/$(basename "$driver_program")
fi
shift
agent=${agent:-$(printf '%q' "$driver_program")}

secret=${ADAG_TOKEN:-$(head -c 32 /dev/urandom | base64)}
join_timeout=${ADAG_JOIN_TIMEOUT:-120}
ssh_program=${ADAG_SSH:-ssh}

pids=()
# shellcheck disable=SC2329 # run by the EXIT trap
cleanup() {
    # Agents leave by themselves when the driver goes; a host that never joined is stopped.
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT

for host in "${hosts[@]}"; do
    remote="read -r ADAG_TOKEN; export ADAG_TOKEN; export ADAG_JOIN=$(printf '%q' "$listen")"
    remote+=" ADAG_HOST_NAME=$(printf '%q' "$host") ADAG_JOIN_TIMEOUT=$(printf '%q' "$join_timeout");"
    remote+=" exec $agent"
    printf '%s\n' "$secret" | "$ssh_program" "$host" "$remote" &
    pids+=("$!")
done

status=0
ADAG_LISTEN=$listen ADAG_TOKEN=$secret "$driver_program" "$@" || status=$?
# Give the agents a moment to see the driver leave, then return its status.
for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
done
exit "$status"
