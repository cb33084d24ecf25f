"""adag on a Ray cluster: Ray places, starts and cleans up adag's hosts; adag moves the data.

``adag.init(ray_address=...)`` connects to Ray (or takes the connection of an earlier
``ray.init()``), makes this driver listen on its Ray node's address with a fresh secret, and
starts one adag agent on every other alive Ray node: a Ray actor pinned there
(``NodeAffinitySchedulingStrategy(node_id, soft=False)``, ``num_cpus=0``) whose child process
is ``python -m adag.agent``. The driver's own Ray node is adag's host 0 (the driver's host):
actors placed there are the driver's own worker processes, with shared-memory channels.

Why a child process and not the agent in the Ray actor itself: the agent owns its process
(it forks workers, exits when the driver leaves) and a Ray worker is Ray's. The child gets
``PR_SET_PDEATHSIG``: when the Ray actor's process dies (``ray.kill``, the node removed, the
driver gone), the kernel kills the agent, the agent's workers die with it, and the driver
sees the host lost at once.

Internal: the names are exported by :mod:`adag` (``init``, ``add_ray_nodes``,
``shutdown``) and used by :mod:`adag.cluster` (placement by Ray node id and resources).
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

from . import _native, cluster
from .exceptions import AdagError, PlacementError

#: Seconds ``adag.init(ray_address=...)`` and :func:`add_ray_nodes` wait for the agents to
#: join by default (a Ray actor starts in a second or two; a busy cluster takes longer).
JOIN_TIMEOUT = 60.0

# Run by the agent's child before it becomes the agent (`exec`): ask the kernel for SIGKILL
# when the thread that forked it ends (PR_SET_PDEATHSIG = 1, SIGKILL = 9; kept across exec),
# then check the parent is still the one that forked it (it may have died before the prctl).
# A bootstrap rather than `preexec_fn`: code between fork and exec in a Ray worker, which runs
# many threads, is asking for a deadlock.
_BOOT = (
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0:\n"
    "    sys.exit('adag: prctl(PR_SET_PDEATHSIG) failed: the agent would outlive its Ray actor')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _agent_class() -> type:
    """The Ray actor that runs one host's agent. Made inside a function so that Ray ships it
    by value: the Ray worker needs nothing but the standard library (the agent, its child,
    imports adag)."""

    class AdagAgent:
        def __init__(self, env: Dict[str, str], extra_path: str) -> None:
            import subprocess

            full = dict(os.environ)
            full.update(env)
            # The driver's adag first (the same build, where the file system is shared),
            # then whatever the node's Python finds.
            full["PYTHONPATH"] = os.pathsep.join(
                p for p in [extra_path, full.get("PYTHONPATH", "")] if p
            )
            argv = [sys.executable, "-c", _BOOT, str(os.getpid())]
            argv += [sys.executable, "-m", "adag.agent"]
            self._proc: Any = None
            self._error: Optional[str] = None
            started = threading.Event()

            def run() -> None:
                # PR_SET_PDEATHSIG fires when the *thread* that forked the child ends: this
                # thread forks it and then waits for it, so it ends only with the child or
                # with the process.
                try:
                    self._proc = subprocess.Popen(argv, env=full, stdin=subprocess.DEVNULL)
                except BaseException as e:  # reported by pid()
                    self._error = f"{type(e).__name__}: {e}"
                    return
                finally:
                    started.set()
                self._proc.wait()

            threading.Thread(target=run, name="adag-agent", daemon=True).start()
            started.wait(60)

        def pid(self) -> int:
            if self._proc is None:
                raise RuntimeError(f"cannot start python -m adag.agent: {self._error}")
            return self._proc.pid

        def poll(self) -> Optional[int]:
            return None if self._proc is None else self._proc.poll()

    return AdagAgent


def host_name(ray_node_id: str) -> str:
    """The name of the adag host on a Ray node (what :func:`adag.nodes` lists and errors
    name): ``ray-`` and the first 12 hex digits of the node id."""
    return f"ray-{ray_node_id[:12]}"


class _Agent:
    """One Ray node's agent, as the driver knows it."""

    def __init__(self, node: Mapping[str, Any], actor: Any) -> None:
        self.node_id: str = node["NodeID"]
        self.ip: str = node.get("NodeManagerAddress", "?")
        self.resources: Dict[str, float] = dict(node.get("Resources") or {})
        self.name = host_name(self.node_id)
        self.actor = actor
        self.pid_ref = actor.pid.remote()
        self.pid: Optional[int] = None
        self.host: Optional[int] = None
        self.failure: Optional[str] = None

    def describe(self) -> str:
        return f"{self.node_id} ({self.ip}, adag host {self.name})"


class _State:
    def __init__(self, driver_node: Optional[Mapping[str, Any]], started_ray: bool) -> None:
        self.driver_node_id: Optional[str] = driver_node["NodeID"] if driver_node else None
        self.driver_resources: Dict[str, float] = dict(
            (driver_node or {}).get("Resources") or {}
        )
        self.started_ray = started_ray
        self.agents: Dict[str, _Agent] = {}
        # Every host an agent of ours ever was (lost ones too, which adag.nodes() still
        # lists): host id -> (Ray node id, the node's resources).
        self.hosts: Dict[int, Tuple[str, Dict[str, float]]] = {}


_lock = threading.RLock()
_state: Optional[_State] = None


def active() -> bool:
    """Whether this driver runs on a Ray cluster (``adag.init(ray_address=...)``)."""
    return _state is not None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise AdagError(
            "adag.init(ray_address=...) runs adag on a Ray cluster and needs Ray in this "
            "Python: pip install 'ray>=2.60' (or leave out ray_address to run without Ray)"
        ) from None
    return ray


def init(
    ray_address: Optional[str],
    listen: Optional[str],
    token: Optional[str],
    heartbeat_timeout: Optional[float],
    timeout: float,
    ray_options: Dict[str, Any],
) -> str:
    """``adag.init(ray_address=...)``; the address the agents joined."""
    global _state
    ray = _import_ray()
    with _lock:
        if _state is not None:
            if ray_options.get("ignore_reinit_error"):
                return str(cluster.address())
            raise AdagError(
                "adag.init(ray_address=...) already ran in this process: call adag.shutdown() "
                "first, adag.add_ray_nodes() for Ray nodes that joined since, or pass "
                "ignore_reinit_error=True"
            )
        started_ray = not ray.is_initialized()
        if started_ray:
            ray.init(address=ray_address, **ray_options)
        try:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            here = ray.get_runtime_context().get_node_id()
            driver_node = next((n for n in alive if n["NodeID"] == here), None)
            if cluster.address() is None:
                ip = (driver_node or {}).get("NodeManagerAddress") or ray.util.get_node_ip_address()
                host = f"[{ip}]" if ":" in ip else ip
                cluster.listen(
                    listen or f"{host}:0", token or secrets.token_hex(16), heartbeat_timeout
                )
            elif (listen is not None and listen != cluster.address()) or (
                token is not None and token != cluster._token
            ):
                raise AdagError(
                    f"this driver already listens for hosts on {cluster.address()} with its "
                    "secret (one listener per process): leave out listen= and token= to have "
                    "the Ray nodes join there"
                )
        except BaseException:
            if started_ray:
                ray.shutdown()
            raise
        _state = _State(driver_node, started_ray)
    try:
        add_ray_nodes(timeout)
    except BaseException:
        shutdown()
        raise
    return str(cluster.address())


def add_ray_nodes(timeout: float = JOIN_TIMEOUT) -> List[Dict[str, Any]]:
    """Start an agent on every alive Ray node that has no live adag host (the nodes that
    joined the Ray cluster since ``adag.init(ray_address=...)``, and those whose agent was
    lost), and wait up to ``timeout`` seconds for them to join; returns :func:`adag.nodes`.

    Raises :class:`~adag.exceptions.AdagError` naming the Ray nodes whose agent did not join
    (and why, when known); the agents that did join stay."""
    ray = _import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with _lock:
        state = _state
        if state is None:
            raise AdagError(
                "adag.add_ray_nodes() needs adag on a Ray cluster: call "
                "adag.init(ray_address='auto') first"
            )
        live = {h[0] for h in _native.hosts()}
        alive = [n for n in ray.nodes() if n.get("Alive")]
        alive_ids = {n["NodeID"] for n in alive}
        # Forget the agents of Ray nodes that left and the agents whose host was lost.
        for node_id, agent in list(state.agents.items()):
            if node_id not in alive_ids or agent.host not in live:
                _kill_actor(ray, agent.actor)
                del state.agents[node_id]
        root = _source_root()
        env = {
            cluster.ENV_JOIN: str(cluster.address()),
            cluster.ENV_TOKEN: str(cluster._token),
        }
        actor_class = ray.remote(num_cpus=0, max_restarts=0)(_agent_class())
        new: List[_Agent] = []
        for node in alive:
            node_id = node["NodeID"]
            if node_id == state.driver_node_id or node_id in state.agents:
                continue
            actor = actor_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
            ).remote(dict(env, **{cluster.ENV_HOST_NAME: host_name(node_id)}), root)
            agent = _Agent(node, actor)
            state.agents[node_id] = agent
            new.append(agent)
    _wait_joined(ray, new, timeout)
    return cluster.nodes()


def _source_root() -> str:
    """Where this adag is imported from, when that is a source tree (``python/`` of a
    checkout): the agents' Python looks there first, so that a driver run from a checkout
    gets agents of the same code wherever the file system is shared. An installed adag
    (site-packages) gives "": the nodes' Python finds its own installed adag, and
    site-packages ahead of the standard library could shadow it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return "" if os.path.basename(root) in ("site-packages", "dist-packages") else root


def _wait_joined(ray: Any, agents: List[_Agent], timeout: float) -> None:
    """Wait until every agent of ``agents`` joined, one failed, or ``timeout`` passed. Ray is
    asked about all agents at once (one ``ray.wait`` per round, whatever the node count)."""
    deadline = time.monotonic() + timeout
    next_poll = time.monotonic() + 0.5
    while True:
        starting = [a for a in agents if a.pid is None and a.failure is None]
        if starting:
            ready, _ = ray.wait([a.pid_ref for a in starting], num_returns=len(starting), timeout=0)
            for a in starting:
                if a.pid_ref in ready:
                    try:
                        a.pid = ray.get(a.pid_ref)
                    except Exception as e:  # the actor could not start (node died, ...)
                        a.failure = f"its Ray actor failed: {_first_line(e)}"
        joined = {(name, pid): h for h, name, _, _, pid in _native.hosts()}
        for a in agents:
            if a.host is None and a.pid is not None:
                a.host = joined.get((a.name, a.pid))
                if a.host is not None and _state is not None:
                    _state.hosts[a.host] = (a.node_id, a.resources)
        waiting = [a for a in agents if a.host is None and a.failure is None]
        if not waiting:
            break
        now = time.monotonic()
        running = [a for a in waiting if a.pid is not None]
        if running and now >= next_poll:  # an agent that exited will never join: say so now
            next_poll = now + 0.5
            polls = [a.actor.poll.remote() for a in running]
            ready, _ = ray.wait(polls, num_returns=len(polls), timeout=5)
            for a, ref in zip(running, polls):
                try:
                    code = ray.get(ref) if ref in ready else None
                except Exception as e:  # its node left, or the actor was killed
                    a.failure = f"its Ray actor died: {_first_line(e)}"
                    continue
                if code is not None:
                    why = " (it could not join: see its stderr)" if code == 3 else ""
                    a.failure = f"its agent (pid {a.pid}) exited with status {code}{why}"
        if now >= deadline:
            for a in waiting:
                if a.failure is None:
                    a.failure = (
                        f"its Ray actor did not start within {timeout:g} s"
                        if a.pid is None
                        else f"its agent (pid {a.pid}) runs but did not join within {timeout:g} s"
                    )
            break
        time.sleep(0.02)
    failed = [a for a in agents if a.failure is not None]
    if not failed:
        return
    with _lock:
        for a in failed:
            _kill_actor(ray, a.actor)
            if _state is not None and _state.agents.get(a.node_id) is a:
                del _state.agents[a.node_id]
    lines = "; ".join(f"Ray node {a.describe()}: {a.failure}" for a in failed)
    raise AdagError(
        f"{len(failed)} of {len(agents)} Ray node(s) did not join adag: {lines}. The agent's "
        "messages are in the Ray worker logs of its node (lines starting 'adag agent:'). "
        f"Check that the node's Python imports adag (the same version), that {cluster.address()} "
        "is reachable from the node, that the node is alive; then call adag.add_ray_nodes() "
        "(timeout= to wait longer)"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _kill_actor(ray: Any, actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:  # already dead, or Ray disconnected (which killed it)
        pass


def shutdown(timeout: float = 15.0) -> None:
    """Kill every agent actor (their agents and workers die with them), wait up to
    ``timeout`` seconds until the driver has seen their hosts leave, and disconnect from Ray
    if ``adag.init`` connected. Does nothing when adag does not run on Ray."""
    global _state
    with _lock:
        state, _state = _state, None
        _claims.clear()
    if state is None:
        return
    import ray

    hosts = {a.host for a in state.agents.values() if a.host is not None}
    if ray.is_initialized():
        for a in state.agents.values():
            _kill_actor(ray, a.actor)
    deadline = time.monotonic() + timeout
    while hosts & {h[0] for h in _native.hosts()} and time.monotonic() < deadline:
        time.sleep(0.02)
    left = hosts & {h[0] for h in _native.hosts()}
    if state.started_ray and ray.is_initialized():
        ray.shutdown()
    if left:
        warnings.warn(
            f"adag.shutdown(): adag hosts {sorted(left)} were still joined {timeout:g} s after "
            "their Ray actors were killed (they leave at the heartbeat timeout)",
            RuntimeWarning,
        )


# --- placement ----------------------------------------------------------------------------


def host_of_ray_node(node_id: Any) -> Optional[Tuple[Optional[int], str]]:
    """For a Ray node id: ``(host, how)`` with its adag host (0: the driver's node; ``None``
    when it has no live host), or ``None`` when ``node_id`` is no Ray node id we know."""
    state = _state
    if state is None or not isinstance(node_id, str):
        return None
    if node_id == state.driver_node_id:
        return 0, "the driver's Ray node"
    agent = state.agents.get(node_id)
    if agent is None:
        if not _looks_like_ray_node_id(node_id):
            return None  # adag's own NodeID ("1"), or nothing we know: the caller says
        return None, (
            f"Ray node {node_id} has no adag host (not alive, or it joined the Ray cluster "
            "after adag.init: call adag.add_ray_nodes())"
        )
    live = {h[0] for h in _native.hosts()}
    if agent.host in live:
        return agent.host, agent.name
    return None, (
        f"the adag host {agent.name} of Ray node {node_id} was lost (the node left, or its "
        "agent died); adag.add_ray_nodes() starts a new one on a live node"
    )


def _looks_like_ray_node_id(text: str) -> bool:
    """Ray's node ids are 28 bytes, written as 56 hex digits."""
    return len(text) == 56 and all(c in "0123456789abcdef" for c in text.lower())


def ray_node_of(host: int) -> Optional[str]:
    """The Ray node id of an adag host, or ``None`` (not on Ray, or a host Ray did not
    start)."""
    state = _state
    if state is None:
        return None
    if host == 0:
        return state.driver_node_id
    known = state.hosts.get(host)
    return known[0] if known else None


def resources_of(host: int) -> Optional[Dict[str, float]]:
    """The Ray resources of an adag host's node (``ray.nodes()``), or ``None``."""
    state = _state
    if state is None:
        return None
    if host == 0:
        return dict(state.driver_resources) if state.driver_node_id else None
    known = state.hosts.get(host)
    return dict(known[1]) if known else None


def request(options: Mapping[str, Any]) -> Dict[str, float]:
    """The Ray resources an actor's options ask for (``num_cpus``, ``num_gpus``, ``memory``,
    ``resources``), as Ray names them; only what is asked explicitly."""
    want: Dict[str, float] = {}
    for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
        v = options.get(key)
        if v:
            want[name] = float(v)
    for name, v in (options.get("resources") or {}).items():
        if v:
            want[str(name)] = float(v)
    return want


# Resources held by live actors: claim id -> (host, request). An actor's claim ends when its
# handle is dropped (its process ends then) or it is killed.
_claims: Dict[int, Tuple[int, Dict[str, float]]] = {}
_claim_ids = iter(range(1, 1 << 62))


def free(host: int) -> Dict[str, float]:
    """What of its Ray node's resources host ``host`` has not given to live actors."""
    have = resources_of(host) or {}
    with _lock:
        for h, want in _claims.values():
            if h == host:
                for k, v in want.items():
                    have[k] = have.get(k, 0.0) - v
    return have


def fits(host: int, want: Mapping[str, float]) -> bool:
    have = free(host)
    return all(have.get(k, 0.0) >= v - 1e-9 for k, v in want.items())


def choose(actor: str, want: Dict[str, float], hosts: List[int], how: str) -> int:
    """The first host of ``hosts`` with ``want`` free; :class:`PlacementError` if none."""
    for h in hosts:
        if fits(h, want):
            return h
    free_text = ", ".join(
        f"{_host_label(h)}: " + ", ".join(f"{k} {free(h).get(k, 0.0):g}" for k in want)
        for h in hosts
    )
    raise PlacementError(
        f"actor {actor} asks for {_fmt(want)} ({how}), but no live host has that free "
        f"({free_text or 'no host'}); Ray would leave the actor pending, adag refuses: add Ray "
        "nodes with those resources and call adag.add_ray_nodes(), release actors that hold "
        "them (drop their handles or adag.kill), or ask for less"
    )


def _fmt(want: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in want.items()) + "}"


def _host_label(host: int) -> str:
    if host == 0:
        return "host 0 (the driver's)"
    for a in (_state.agents.values() if _state else []):
        if a.host == host:
            return f"host {host} ({a.name})"
    return f"host {host}"


def claim(handle: Any, host: int, want: Dict[str, float]) -> None:
    """Count ``want`` as held on ``host`` while ``handle`` lives (and is not killed)."""
    if not want or _state is None:
        return
    with _lock:
        cid = next(_claim_ids)
        _claims[cid] = (host, want)
    handle._release = weakref.finalize(handle, _release, cid)


def _release(cid: int) -> None:
    with _lock:
        _claims.pop(cid, None)


__all__ = ["JOIN_TIMEOUT", "active", "add_ray_nodes", "host_name", "init", "shutdown"]
