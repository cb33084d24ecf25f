#!/usr/bin/env python3
"""Run an adag program (a Rust binary) on a Ray cluster, as a Ray job's entrypoint.

    ray job submit --working-dir . -- python deploy/ray/launch.py -- ./target/release/my-app ARGS

Ray places and starts the processes, adag moves the data:

- the program runs here (on the Ray node of the job's driver) as adag's driver, with
  ``ADAG_LISTEN=<this node's address>:<port>``, ``ADAG_TOKEN=<a fresh secret>`` and
  ``ADAG_HOSTS=<the number of agents>`` in its environment;
- the same program runs on every other alive Ray node as that host's agent, with
  ``ADAG_JOIN``, ``ADAG_TOKEN`` and ``ADAG_HOST_NAME=ray-<the node id's first 12 hex digits>``,
  each the child of a Ray actor pinned to its node (``NodeAffinitySchedulingStrategy``,
  ``soft=False``, ``num_cpus=0``). The secret travels as an actor argument into the child's
  environment, never on a command line.

Every child gets ``PR_SET_PDEATHSIG``: when its Ray actor (or this launcher) dies, the kernel
kills it, so a removed Ray node takes its agent along (the driver sees the host lost) and a
stopped job (``ray job stop``) leaves nothing. When the driver exits, the agents' actors are
killed and this script exits with the driver's status.

Only Ray is needed here (not the adag Python package). See deploy/ray/README.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional

# A child's first act (the same trick as adag's Python package, python/adag/_ray.py): ask the
# kernel for SIGKILL when the thread that forked it ends (PR_SET_PDEATHSIG = 1, SIGKILL = 9;
# kept across exec), check that parent is still there, then become the program.
BOOT = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0:\n"
    "    sys.exit('adag launcher: prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def spawn_bound(argv: List[str], env: Dict[str, str]) -> "subprocess.Popen[bytes]":
    """Start ``argv`` as a child that dies with this process: it is forked by a thread that
    then waits for it (PR_SET_PDEATHSIG fires when the forking *thread* ends)."""
    box: Dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        try:
            box["proc"] = subprocess.Popen(
                [sys.executable, "-c", BOOT, str(os.getpid())] + argv,
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException as e:
            box["error"] = e
            return
        finally:
            started.set()
        box["proc"].wait()

    threading.Thread(target=run, name="adag-child", daemon=True).start()
    started.wait()
    if "error" in box:
        raise box["error"]
    return box["proc"]


class Agent:
    """A Ray actor pinned to one node, whose child is the program as that node's agent."""

    def __init__(self, argv: List[str], env: Dict[str, str]) -> None:
        self.proc = spawn_bound(argv, dict(os.environ, **env))

    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> Optional[int]:
        return self.proc.poll()


def free_port(ip: str) -> int:
    """A port free on ``ip`` now (the driver binds it a moment later; --port to choose)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="launch.py [options] -- PROGRAM [ARGS...]",
    )
    ap.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS", "auto"),
                    help="the Ray cluster (default: RAY_ADDRESS, else auto)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("ADAG_PORT", "0")),
                    help="the driver's port (default: ADAG_PORT, else a free one)")
    ap.add_argument("--agent", dest="agent_command", default=None,
                    help="what agents run instead of the program (a shell-quoted command, "
                         "e.g. 'python -m adag.agent' for a Python driver)")
    ap.add_argument("--agent-on-driver-node", action="store_true",
                    help="also start an agent on the driver's own Ray node")
    ap.add_argument("--join-timeout", type=float, default=120.0,
                    help="seconds an agent may take to start before the launcher gives up")
    ap.add_argument("program", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        ap.error("give the program to run after --")
    agent_argv = shlex.split(args.agent_command) if args.agent_command else program

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ray.init(address=args.ray_address, log_to_driver=True)
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    me = next((n for n in nodes if n["NodeID"] == here), None)
    ip = me["NodeManagerAddress"] if me else ray.util.get_node_ip_address()
    port = args.port or free_port(ip)
    host = f"[{ip}]" if ":" in ip else ip
    token = os.environ.get("ADAG_TOKEN") or secrets.token_hex(32)
    targets = [n for n in nodes if args.agent_on_driver_node or n["NodeID"] != here]

    agent_class = ray.remote(num_cpus=0, max_restarts=0)(Agent)
    agents = []
    for n in targets:
        env = {
            "ADAG_JOIN": f"{host}:{port}",
            "ADAG_TOKEN": token,
            "ADAG_HOST_NAME": f"ray-{n['NodeID'][:12]}",
        }
        actor = agent_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(agent_argv, env)
        agents.append((n, actor, actor.pid.remote()))
    print(f"adag launcher: driver {program[0]} on {host}:{port}, {len(agents)} agent(s) "
          f"on Ray nodes {', '.join(n['NodeID'][:12] for n, _, _ in agents) or '(none)'}",
          file=sys.stderr, flush=True)

    driver_env = dict(os.environ, ADAG_LISTEN=f"{host}:{port}", ADAG_TOKEN=token,
                      ADAG_HOSTS=str(len(agents)))
    driver_env.pop("ADAG_JOIN", None)
    driver = spawn_bound(program, driver_env)

    def stop(signum: int, _frame: Any) -> None:
        # `ray job stop` and Ctrl-C: end the driver; the agents follow (killed below).
        try:
            driver.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    # Watch: an agent whose actor or program ends early is said at once (the driver, which
    # waits for ADAG_HOSTS hosts, times out on its own).
    deadline = time.monotonic() + args.join_timeout
    running: Dict[int, Any] = {}  # agent index -> its actor, once its program started
    pending = dict(enumerate(agents))

    def say(n: Dict[str, Any], what: str) -> None:
        print(f"adag launcher: the agent on Ray node {n['NodeID']} {what}", file=sys.stderr,
              flush=True)

    while driver.poll() is None:
        for i, (n, actor, pid_ref) in list(pending.items()):
            if ray.wait([pid_ref], timeout=0)[0]:
                del pending[i]
                try:
                    ray.get(pid_ref)
                    running[i] = actor
                except Exception as e:
                    say(n, f"could not start: {str(e).splitlines()[0]}")
            elif time.monotonic() > deadline:
                del pending[i]
                say(n, f"did not start within {args.join_timeout:g} s")
        if running:
            polls = {i: a.poll.remote() for i, a in running.items()}
            ready, _ = ray.wait(list(polls.values()), num_returns=len(polls), timeout=5)
            for i, ref in polls.items():
                try:
                    code = ray.get(ref) if ref in ready else None
                except Exception:
                    code = "its Ray actor died"  # the node went away
                if code is not None:
                    del running[i]
                    say(agents[i][0], f"ended ({code}; status 3: it could not join)")
        time.sleep(0.5)
    status = driver.returncode
    for _, actor, _ in agents:
        try:
            ray.kill(actor)
        except Exception:
            pass
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
