"""adag: Ray Compiled Graphs' Python API, backed by adag's Rust runtime.

A Ray Compiled Graphs program ports by changing its imports::

    import adag
    from adag import InputNode, MultiOutputNode

    @adag.remote
    class Echo:
        def echo(self, x):
            return x

    a = Echo.remote()
    with InputNode() as inp:
        dag = a.echo.bind(inp)
    compiled = dag.experimental_compile()
    assert adag.get(compiled.execute(1)) == 1
    compiled.teardown()

Each actor is a worker process running Python; values travel as pickle protocol 5 with
out-of-band buffers in shared memory (numpy arrays arrive as views of it). See
``docs/python.md`` in the repository.
"""

from __future__ import annotations

import os as _os
from typing import Any, List, Optional, Sequence, Union

# The native module's start-up hook would turn this process into a host's agent while it is
# being loaded when ADAG_JOIN is set: hosts run ``python -m adag.agent``, which enters the
# agent explicitly, and no Python process becomes one by importing adag.
_join = _os.environ.pop("ADAG_JOIN", None)
try:
    from . import _native  # noqa: F401
finally:
    if _join is not None:
        _os.environ["ADAG_JOIN"] = _join
del _join

from . import exceptions
from ._actor import (
    ActorClass,
    ActorHandle,
    ActorMethod,
    ObjectRef,
    RemoteFunction,
    method,
    put,
    remote,
    wait,
)
from ._dag import (
    ClassMethodNode,
    CompiledDAG,
    CompiledDAGFuture,
    CompiledDAGRef,
    DAGNode,
    InputAttributeNode,
    InputNode,
    MultiOutputNode,
)
from .cluster import nodes, wait_for_nodes
from .exceptions import (
    ActorDiedError,
    AdagError,
    CapacityExceededError,
    ChannelClosedError,
    CompileError,
    GetTimeoutError,
    PlacementError,
    TaskError,
    WrongModeError,
)
from . import collective, dag, experimental, util  # noqa: E402  (Ray's module layout)

_Ref = Union[CompiledDAGRef, ObjectRef, CompiledDAGFuture]


def _get(refs: Union[_Ref, Sequence[_Ref]], timeout: Optional[float] = None) -> Any:
    """:func:`get` of anything but one ``CompiledDAGRef`` (which the native ``get`` takes
    itself, without this frame)."""
    if isinstance(refs, (list, tuple)):
        compiled = [isinstance(r, CompiledDAGRef) for r in refs]
        if any(compiled) and not all(compiled):
            raise ValueError(
                "Invalid type of object refs. 'object_refs' must be a list of CompiledDAGRefs "
                "if there is any CompiledDAGRef within it. "
            )
        return [get(r, timeout) for r in refs]
    if isinstance(refs, (CompiledDAGRef, ObjectRef, CompiledDAGFuture)):
        return refs.get(timeout)
    raise ValueError(
        f"Invalid type of object refs, {type(refs)}, is given. 'object_refs' must either be an "
        "ObjectRef or a list of ObjectRefs."
    )


#: ``adag.get(refs, timeout=None)``: the value of a ref, or the values of a list of refs, in
#: order (Ray's ``ray.get``); ``timeout`` in seconds for each ref (``None``: the graph's
#: default for compiled-graph refs, for ever for one-off calls). Raises :class:`TaskError`
#: (also an instance of the method's own exception type) when a method failed,
#: :class:`GetTimeoutError` on timeout (the ref stays valid), :class:`ActorDiedError` when
#: an actor died. Native: one ref costs no Python frame (the rest goes through ``_get``).
get = _native.get


def empty(shape: Union[int, Sequence[int]], dtype: Any = float) -> Any:
    """A numpy array for a method's result, with uninitialised contents (``numpy.empty``),
    built where the result travels: inside an actor method of a compiled graph it lies in the
    shared memory of the method's output channel, so returning it (or a view of it) writes
    its bytes once, in place, instead of copying them after the method. Elsewhere (outside a
    method, a result read only by the same process) it is an ordinary array. Write every
    element, and do not change the array after returning it: its readers read that memory."""
    import numpy as np

    dt = np.dtype(dtype)
    dims = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
    count = 1
    for d in dims:
        count *= d
    if count == 0 or dt.itemsize == 0:
        return np.empty(dims, dt)
    memory = _native.output_buffer(count * dt.itemsize)
    return np.frombuffer(memory, dtype=dt, count=count).reshape(dims)


def kill(actor: ActorHandle) -> None:
    """Kill an actor's worker process at once (Ray's ``ray.kill``); its graph is torn down."""
    actor._kill()


__all__ = [
    "ActorClass",
    "ActorDiedError",
    "ActorHandle",
    "ActorMethod",
    "AdagError",
    "CapacityExceededError",
    "ChannelClosedError",
    "ClassMethodNode",
    "CompileError",
    "CompiledDAG",
    "CompiledDAGFuture",
    "CompiledDAGRef",
    "DAGNode",
    "GetTimeoutError",
    "InputAttributeNode",
    "InputNode",
    "MultiOutputNode",
    "ObjectRef",
    "PlacementError",
    "RemoteFunction",
    "TaskError",
    "WrongModeError",
    "collective",
    "dag",
    "empty",
    "exceptions",
    "experimental",
    "get",
    "kill",
    "method",
    "nodes",
    "put",
    "remote",
    "util",
    "wait",
    "wait_for_nodes",
]


__version__ = "0.1.0"


#: Keywords of Ray's ``ray.init`` that adag accepts and ignores: actors are worker processes
#: of this interpreter (or of hosts that joined), so there is no cluster to size or address.
_RAY_INIT_OPTIONS = {
    "address",
    "num_cpus",
    "num_gpus",
    "resources",
    "labels",
    "object_store_memory",
    "local_mode",
    "ignore_reinit_error",
    "include_dashboard",
    "dashboard_host",
    "dashboard_port",
    "job_config",
    "configure_logging",
    "logging_level",
    "logging_format",
    "logging_config",
    "log_to_driver",
    "namespace",
    "runtime_env",
    "storage",
    "enable_resource_isolation",
    "system_reserved_cpu",
    "system_reserved_memory",
    "_system_config",
    "_temp_dir",
    "_node_ip_address",
    "_enable_object_reconstruction",
    "_plasma_directory",
    "_metrics_export_port",
    "_memory",
    "_redis_password",
    "_tracing_startup_hook",
}

#: The variable a driver listens on when ``adag.init()`` is given no ``listen=`` (with
#: ``ADAG_TOKEN``): launch recipes configure a driver without code of the user's.
ENV_LISTEN = "ADAG_LISTEN"


def init(
    address: Optional[str] = None,
    *,
    listen: Optional[str] = None,
    token: Optional[str] = None,
    heartbeat_timeout: Optional[float] = None,
    ray_address: Optional[str] = None,
    timeout: Optional[float] = None,
    **ray_options: Any,
) -> Optional[str]:
    """Ray's ``ray.init``. Without ``listen=`` or ``ray_address=`` (and without
    ``ADAG_LISTEN`` in the environment) it does nothing: actors are worker processes of this
    interpreter, started by ``.remote()``. ``address`` and Ray's other keywords
    (``num_cpus``, ``namespace``, ``runtime_env``, ``ignore_reinit_error``, ...) are accepted
    and ignored; a keyword Ray's ``init`` does not have either is a ``TypeError`` (so a
    misspelt option is not lost).

    ``ray_address="auto"`` (or a Ray cluster's address) runs adag on a Ray cluster: Ray
    places and starts adag's hosts, adag moves the data. It connects to Ray (with Ray's
    keywords given here; an earlier ``ray.init()`` of this process is used as it is), listens
    on the address of the driver's Ray node (any free port, or ``listen=``) with a fresh
    random secret (or ``token=``), and starts an adag agent on every other alive Ray node (a
    Ray actor pinned to it, ``num_cpus=0``); returns once all joined (``timeout`` seconds at
    most, 60 by default: :class:`~adag.exceptions.AdagError` names the Ray nodes that did
    not join and what to check). Then ``NodeAffinitySchedulingStrategy(node_id=<Ray node
    id>)`` (Ray's class or adag's) places an actor on that node, ``num_gpus=``/``resources=``
    choose among the nodes that have them free, :func:`nodes` lists each host's
    ``"RayNodeID"``, :func:`add_ray_nodes` adds Ray nodes that joined later, and
    :func:`shutdown` kills the agents. See ``docs/multi-host.md`` (On a Ray cluster).

    ``listen="ip:port"`` (or ``ADAG_LISTEN``) makes this driver listen for other hosts
    (port 0: any free one; loopback only reaches this machine, ``0.0.0.0`` every interface),
    with the shared secret ``token`` (default: ``ADAG_TOKEN``); returns the address hosts
    join with ``ADAG_JOIN=<address> ADAG_TOKEN=<secret> python -m adag.agent``. Then
    :func:`wait_for_nodes`, :func:`nodes`, and ``.options(scheduling_strategy=
    NodeAffinitySchedulingStrategy(node_id=...))`` to place actors there
    (:mod:`adag.cluster`). ``heartbeat_timeout``: seconds of silence after which a host is
    lost (default 5).
    """
    unknown = set(ray_options) - _RAY_INIT_OPTIONS
    if unknown:
        raise TypeError(
            f"adag.init() got unknown keyword arguments: {', '.join(sorted(unknown))} "
            "(adag takes listen=, token=, heartbeat_timeout= and accepts Ray's own init "
            "keywords; see docs/python.md)"
        )
    if listen is None:
        listen = _os.environ.get(ENV_LISTEN) or None
    if ray_address is not None:
        from . import _ray

        return _ray.init(
            ray_address,
            listen,
            token,
            heartbeat_timeout,
            _ray.JOIN_TIMEOUT if timeout is None else timeout,
            ray_options,
        )
    if timeout is not None:
        raise TypeError("timeout= goes with ray_address= (how long the Ray nodes may take to join)")
    if listen is None:
        if token is not None or heartbeat_timeout is not None:
            raise TypeError("token= and heartbeat_timeout= go with listen=\"ip:port\"")
        return None
    from . import cluster

    if cluster.address() is not None and ray_options.get("ignore_reinit_error"):
        return cluster.address()
    return cluster.listen(listen, token, heartbeat_timeout)


def is_initialized() -> bool:
    """Ray's ``ray.is_initialized``: always true (adag needs no cluster to start)."""
    return True


def shutdown() -> None:
    """Ray's ``ray.shutdown``: tears down every live compiled graph of this process, then
    ends every actor this driver started (their worker processes are killed and gone when it
    returns, on other hosts too); a handle of those actors raises
    :class:`~adag.exceptions.RaySystemError` afterwards, as Ray's do, and the next
    ``.remote()`` starts afresh. On a Ray cluster (``init(ray_address=...)``) it also kills
    the agents' Ray actors, with them the agents and their workers, waits (bounded) until the
    driver has seen those hosts leave, and disconnects from Ray if ``init`` connected."""
    from . import _actor, _ray
    from ._dag import _teardown_all

    _teardown_all()
    _actor._end_session()
    _ray.shutdown()


def add_ray_nodes(timeout: float = 60.0) -> List[dict]:
    """On a Ray cluster (``init(ray_address=...)``): start an adag agent on every alive Ray
    node that has no adag host yet (it joined the Ray cluster later, or its agent was lost)
    and wait up to ``timeout`` seconds for them to join; returns :func:`nodes`. Raises
    :class:`~adag.exceptions.AdagError` naming the Ray nodes that did not join."""
    from . import _ray

    return _ray.add_ray_nodes(timeout)


__all__ += ["add_ray_nodes", "init", "is_initialized", "shutdown", "__version__"]
