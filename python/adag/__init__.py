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
from ._actor import ActorClass, ActorHandle, ActorMethod, ObjectRef, method, remote
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

_Ref = Union[CompiledDAGRef, ObjectRef, CompiledDAGFuture]


def _get(refs: Union[_Ref, Sequence[_Ref]], timeout: Optional[float] = None) -> Any:
    """:func:`get` of anything but one ``CompiledDAGRef`` (which the native ``get`` takes
    itself, without this frame)."""
    if isinstance(refs, (list, tuple)):
        return [get(r, timeout) for r in refs]
    if isinstance(refs, (CompiledDAGRef, ObjectRef, CompiledDAGFuture)):
        return refs.get(timeout)
    raise TypeError(f"adag.get takes refs, or a list of refs, not {type(refs).__name__}")


#: ``adag.get(refs, timeout=None)``: the value of a ref, or the values of a list of refs, in
#: order (Ray's ``ray.get``); ``timeout`` in seconds for each ref (``None``: the graph's
#: default for compiled-graph refs, for ever for one-off calls). Raises :class:`TaskError`
#: (also an instance of the method's own exception type) when a method failed,
#: :class:`GetTimeoutError` on timeout (the ref stays valid), :class:`ActorDiedError` when
#: an actor died. Native: one ref costs no Python frame (the rest goes through ``_get``).
get = _native.get


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
    "TaskError",
    "WrongModeError",
    "exceptions",
    "get",
    "kill",
    "method",
    "nodes",
    "remote",
    "wait_for_nodes",
]


__version__ = "0.1.0"


def init(
    address: Optional[str] = None,
    *,
    listen: Optional[str] = None,
    token: Optional[str] = None,
    heartbeat_timeout: Optional[float] = None,
    **_ray_options: Any,
) -> Optional[str]:
    """Ray's ``ray.init``. Without ``listen=`` it does nothing (accepted so that programs
    port unchanged: actors are worker processes of this interpreter, started by
    ``.remote()``); ``address`` and Ray's other options are accepted and ignored.

    ``listen="ip:port"`` makes this driver listen for other hosts (port 0: any free one;
    loopback only reaches this machine, ``0.0.0.0`` every interface), with the shared secret
    ``token`` (default: ``ADAG_TOKEN``); returns the address hosts join with
    ``ADAG_JOIN=<address> ADAG_TOKEN=<secret> python -m adag.agent``. Then
    :func:`wait_for_nodes`, :func:`nodes`, and ``.options(scheduling_strategy=
    NodeAffinitySchedulingStrategy(node_id=...))`` to place actors there
    (:mod:`adag.cluster`). ``heartbeat_timeout``: seconds of silence after which a host is
    lost (default 5).
    """
    if listen is None:
        if token is not None or heartbeat_timeout is not None:
            raise TypeError("token= and heartbeat_timeout= go with listen=\"ip:port\"")
        return None
    from . import cluster

    return cluster.listen(listen, token, heartbeat_timeout)


def shutdown() -> None:
    """Ray's ``ray.shutdown``: tears down every live compiled graph of this process (actor
    processes end when their handles are dropped, and with the interpreter)."""
    from ._dag import _teardown_all

    _teardown_all()


__all__ += ["init", "shutdown", "__version__"]
