"""Hosts: other machines (or process trees) whose Python actors join one driver.

The driver listens (:func:`adag.init` with ``listen=`` and ``token=``); each host runs
``ADAG_JOIN=<address> ADAG_TOKEN=<secret> python -m adag.agent`` (the same Python
environment as the driver: the same ``adag`` build, the actors' modules importable) and
stays until the driver leaves. :func:`adag.nodes` lists the hosts; an actor is placed on one
with ``.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=...))`` or
``.options(host=<id>)``. Every edge of a compiled graph between two hosts is a TCP channel.

:class:`LocalHosts` starts hosts on this machine, each a process tree of its own on loopback
(tests, examples). See ``docs/python.md`` and ``docs/multi-host.md``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import _native
from .exceptions import AdagError, PlacementError

#: The driver's address, ``host:port``, in a joining host's environment.
ENV_JOIN = "ADAG_JOIN"
#: The shared secret, in the environment of the driver and of every host.
ENV_TOKEN = "ADAG_TOKEN"
#: The host's name as :func:`adag.nodes` lists it (default: the machine's host name).
ENV_HOST_NAME = "ADAG_HOST_NAME"
#: The exit status of an agent that could not join (no driver at the address, another secret).
EXIT_JOIN_FAILED = 3

_lock = threading.Lock()
_address: Optional[str] = None
_token: Optional[str] = None
_spread = itertools.count()


def listen(
    address: str = "127.0.0.1:0",
    token: Optional[str] = None,
    heartbeat_timeout: Optional[float] = None,
) -> str:
    """Listen for hosts joining this driver; returns the address they join (``ADAG_JOIN``).

    ``address`` is ``ip:port`` (port 0: any free one; ``0.0.0.0`` or an interface's address
    for hosts on other machines: the default, loopback, only reaches this machine).
    ``token`` is the shared secret (default: ``ADAG_TOKEN`` of this environment).
    ``heartbeat_timeout``: seconds of silence after which a host counts as lost (default 5).
    One listener per driver process. :func:`adag.init` with ``listen=`` calls this.
    """
    global _address, _token
    if token is None:
        token = os.environ.get(ENV_TOKEN) or None
    if not token:
        raise ValueError(
            "hosts join with a shared secret: pass token=... (or set ADAG_TOKEN), and start "
            "each host with the same ADAG_TOKEN"
        )
    with _lock:
        if _address is not None:
            raise AdagError(
                f"this driver already listens for hosts on {_address}; one listener per "
                "driver process (hosts join that address)"
            )
        _address = _native.listen(address, token, heartbeat_timeout)
        _token = token
        return _address


def address() -> Optional[str]:
    """The address hosts join (``ADAG_JOIN``), or ``None`` when this driver does not listen."""
    return _address


def _driver_node() -> Dict[str, Any]:
    name = os.environ.get(ENV_HOST_NAME) or socket.gethostname()
    ip = _address.rsplit(":", 1)[0] if _address else "127.0.0.1"
    return _node(0, name, ip, os.cpu_count() or 1, os.getpid(), driver=True)


def _node(
    host: int, name: str, ip: str, cores: int, pid: int, driver: bool = False
) -> Dict[str, Any]:
    from . import _ray

    return {
        "NodeID": str(host),
        "Alive": True,
        "NodeName": name,
        "NodeManagerAddress": ip,
        "NodeManagerHostname": name,
        # On a Ray cluster: the resources Ray gives the host's node (what num_gpus= and
        # resources= of an actor are matched against).
        "Resources": _ray.resources_of(host) or {"CPU": float(cores)},
        "IsDriver": driver,
        "AgentPid": pid,
        "RayNodeID": _ray.ray_node_of(host),
    }


def _joined(hosts: Sequence[Tuple[int, str, str, int, int]]) -> List[Dict[str, Any]]:
    return [
        _node(h, name, addr.rsplit(":", 1)[0].strip("[]"), cores, pid)
        for h, name, addr, cores, pid in hosts
    ]


def _listed(hosts: Sequence[Tuple[Any, ...]]) -> List[Dict[str, Any]]:
    """``_joined`` of every host, lost ones marked (each tuple ends with when and why)."""
    nodes = _joined([h[:5] for h in hosts])
    for node, (*_, lost_at, why) in zip(nodes, hosts):
        if lost_at is not None:
            node["Alive"] = False
            node["DeathReasonMessage"] = why
            node["LostAt"] = lost_at
    return nodes


def nodes() -> List[Dict[str, Any]]:
    """Every host (Ray's ``ray.nodes()``): the driver's host first (``"NodeID": "0"``), then
    every host that joined, in joining order; a host that was lost stays listed with
    ``"Alive": False``, ``"DeathReasonMessage"`` (why) and ``"LostAt"`` (when, seconds since
    the epoch), as Ray lists a dead node.

    Each is a dict with Ray's keys ``"NodeID"`` (pass it to
    ``NodeAffinitySchedulingStrategy``), ``"Alive"``, ``"NodeName"``,
    ``"NodeManagerAddress"``, ``"NodeManagerHostname"``, ``"Resources"`` (``{"CPU": n}``;
    on a Ray cluster the Ray node's resources), and adag's ``"IsDriver"``, ``"AgentPid"``
    (the agent's process id on its host) and ``"RayNodeID"`` (on a Ray cluster, the Ray
    node the host runs on, which ``NodeAffinitySchedulingStrategy`` takes too; else
    ``None``).
    """
    return [_driver_node()] + _listed(_native.all_hosts())


def wait_for_nodes(count: int, timeout: float = 60.0) -> List[Dict[str, Any]]:
    """Wait until ``count`` hosts have joined (the driver's own not counted), up to
    ``timeout`` seconds; returns :func:`nodes`. Raises
    :class:`~adag.exceptions.GetTimeoutError` naming the address hosts must join."""
    if _address is None:
        raise AdagError(
            "this driver does not listen for hosts: call adag.init(listen=..., token=...) first"
        )
    return [_driver_node()] + _joined(_native.wait_for_hosts(count, timeout))


def _describe(ns: List[Dict[str, Any]]) -> str:
    return ", ".join(
        f"{n['NodeID']} ({'the driver' if n['IsDriver'] else n['NodeName']})" for n in ns
    )


def _host_id(node_id: Any) -> Optional[int]:
    if isinstance(node_id, int) and not isinstance(node_id, bool):
        return node_id
    if isinstance(node_id, str) and node_id.isdigit():
        return int(node_id)
    return None


def placement(actor: str, options: Mapping[str, Any]) -> int:
    """The host an actor with these ``.options(...)`` runs on (0: the driver's). Raises
    :class:`~adag.exceptions.PlacementError` when it names a host that is not live (or, on
    a Ray cluster, when no host has the resources it asks for free)."""
    from . import _ray

    want = _ray.request(options) if _ray.active() else {}
    if not want:
        return _placement(actor, options)
    # On a Ray cluster the resources an actor asks for (num_gpus=, resources=, ...) choose
    # among the hosts whose Ray node has them free, as Ray's scheduler would.
    strategy = options.get("scheduling_strategy")
    if options.get("host") is not None or hasattr(strategy, "node_id"):
        soft = bool(getattr(strategy, "soft", False))
        try:
            host = _placement(actor, options, hard=True)
        except PlacementError:
            if not soft:
                raise
        else:
            # soft=True (Ray's): a host without the resources free gives way to any that has.
            if not soft or _ray.fits(host, want):
                return _ray.choose(actor, want, [host], f"placed on host {host}")
    ids = [0] + [h[0] for h in _native.hosts()]
    if strategy == "SPREAD":
        k = next(_spread) % len(ids)
        ids = ids[k:] + ids[:k]
    return _ray.choose(actor, want, ids, "any live host")


def _placement(actor: str, options: Mapping[str, Any], hard: bool = False) -> int:
    """The host ``options`` name, whatever they ask for (``hard``: as if ``soft=False``)."""
    from . import _ray

    host = options.get("host")
    strategy = options.get("scheduling_strategy")
    if host is not None and strategy is not None:
        raise TypeError(f"actor {actor}: give host= or scheduling_strategy=, not both")
    soft = False
    how = f"host={host!r}"
    if host is None:
        if strategy is None or strategy == "DEFAULT":
            return 0
        if strategy == "SPREAD":
            ids = [0] + [h[0] for h in _native.hosts()]
            return ids[next(_spread) % len(ids)]
        if isinstance(strategy, str) or not hasattr(strategy, "node_id"):
            raise TypeError(
                f"actor {actor}: scheduling_strategy={strategy!r} is not supported; use "
                '"DEFAULT", "SPREAD" or adag.util.scheduling_strategies.'
                "NodeAffinitySchedulingStrategy(node_id=..., soft=...)"
            )
        host = strategy.node_id
        soft = bool(getattr(strategy, "soft", False)) and not hard
        how = f"NodeAffinitySchedulingStrategy(node_id={host!r}, soft={soft})"
    on_ray = _ray.host_of_ray_node(host)  # a Ray node id, on a Ray cluster
    if on_ray is not None:
        wanted, why = on_ray
        if wanted is not None:
            return wanted
        if soft:
            return 0
        raise PlacementError(
            f"actor {actor} is placed on Ray node {host} ({how}), but {why}; live hosts "
            f"(adag.nodes() lists the RayNodeID of each): "
            f"{_describe([n for n in nodes() if n['Alive']])}; or pass "
            "soft=True to run the actor on the driver's host instead"
        )
    wanted = _host_id(host)
    if wanted == 0:
        return 0
    live = {h[0] for h in _native.hosts()}
    if wanted in live:
        return wanted
    if soft:
        return 0
    if _address is None:
        fix = (
            "this driver does not listen for hosts: call adag.init(listen=..., token=...), "
            f"start the host with {ENV_JOIN}=<that address> {ENV_TOKEN}=<the secret> "
            "python -m adag.agent, and wait for it with adag.wait_for_nodes(n)"
        )
    else:
        fix = (
            f"start it with {ENV_JOIN}={_address} {ENV_TOKEN}=<the secret> python -m "
            "adag.agent and wait for it with adag.wait_for_nodes(n), pick a NodeID of "
            "adag.nodes(), or pass soft=True to run the actor on the driver's host instead"
        )
        if _ray.active():
            fix += " (on a Ray cluster: a RayNodeID of adag.nodes() works too)"
    raise PlacementError(
        f"actor {actor} is placed on host {host!r} ({how}), but no live host has that "
        f"NodeID (live: {_describe([n for n in nodes() if n['Alive']])}); {fix}"
    )


_all_local: "weakref.WeakSet[LocalHosts]" = weakref.WeakSet()


class LocalHosts:
    """Hosts started on this machine: each ``python -m adag.agent`` in a process group of
    its own (a separate process tree, as on another machine), joining this driver on
    loopback. Killed, with everything they started, by :meth:`stop`, at the end of a ``with``
    block, when garbage-collected and at interpreter exit.

    ``address`` and ``token`` default to this driver's (:func:`adag.init` with ``listen=``).
    The hosts are named ``local-0``, ``local-1``, ... (``names=`` for others); ``env`` adds
    variables to every agent's environment. With ``wait=True`` the constructor returns once
    every host joined (raising :class:`~adag.exceptions.AdagError` if one exits first or
    ``timeout`` seconds pass).
    """

    def __init__(
        self,
        count: int,
        address: Optional[str] = None,
        token: Optional[str] = None,
        *,
        names: Optional[Sequence[str]] = None,
        env: Optional[Mapping[str, str]] = None,
        wait: bool = True,
        timeout: float = 60.0,
    ) -> None:
        address = address or _address
        token = token or _token or os.environ.get(ENV_TOKEN)
        if not address or not token:
            raise AdagError(
                "LocalHosts joins a listening driver: call adag.init(listen=..., token=...) "
                "first, or pass address= and token="
            )
        if names is None:
            names = [f"local-{i}" for i in range(count)]
        if len(names) != count:
            raise ValueError(f"names= has {len(names)} names for {count} hosts")
        self.names: List[str] = list(names)
        self._procs: List[subprocess.Popen] = []
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        base = dict(os.environ)
        base.update(env or {})
        base["PYTHONPATH"] = os.pathsep.join(
            p for p in [root, base.get("PYTHONPATH", "")] if p
        )
        try:
            for name in self.names:
                e = dict(base, **{ENV_JOIN: address, ENV_TOKEN: token, ENV_HOST_NAME: name})
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "adag.agent"],
                        env=e,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            _all_local.add(self)
            if wait:
                self.wait(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> List[int]:
        """The agents' process ids."""
        return [p.pid for p in self._procs]

    def node_ids(self) -> List[Optional[str]]:
        """The ``NodeID`` of each host, in order (``None`` for one not joined or lost)."""
        by_pid = {n["AgentPid"]: n["NodeID"] for n in _joined(_native.hosts())}
        return [by_pid.get(p.pid) for p in self._procs]

    def wait(self, timeout: float = 60.0) -> List[str]:
        """Wait until every host joined; their ``NodeID``s in order."""
        deadline = time.monotonic() + timeout
        while True:
            ids = self.node_ids()
            if all(i is not None for i in ids):
                return [i for i in ids if i is not None]
            for name, p in zip(self.names, self._procs):
                code = p.poll()
                if code is not None:
                    raise AdagError(
                        f"local host {name} exited with status {code} before joining "
                        f"(status {EXIT_JOIN_FAILED}: it could not join; see its stderr)"
                    )
            if time.monotonic() > deadline:
                raise AdagError(
                    f"local hosts did not all join within {timeout} s (joined: {ids})"
                )
            time.sleep(0.02)

    def kill(self, index: int) -> None:
        """Kill host ``index``'s agent and everything it started (its process group)."""
        _kill_group(self._procs[index])

    def stop(self) -> None:
        """Kill every host (idempotent)."""
        for p in self._procs:
            _kill_group(p)

    def __enter__(self) -> "LocalHosts":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            self.stop()
        except Exception:
            pass


def _kill_group(p: "subprocess.Popen[Any]") -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
        pass


@atexit.register
def _stop_all_local() -> None:
    for hosts in list(_all_local):
        hosts.stop()


__all__ = [
    "ENV_HOST_NAME",
    "ENV_JOIN",
    "ENV_TOKEN",
    "EXIT_JOIN_FAILED",
    "LocalHosts",
    "address",
    "listen",
    "nodes",
    "wait_for_nodes",
]
