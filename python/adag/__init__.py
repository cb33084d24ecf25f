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

from typing import Any, List, Optional, Sequence, Union

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
from .exceptions import (
    ActorDiedError,
    AdagError,
    CapacityExceededError,
    ChannelClosedError,
    CompileError,
    GetTimeoutError,
    TaskError,
    WrongModeError,
)

_Ref = Union[CompiledDAGRef, ObjectRef, CompiledDAGFuture]


def get(refs: Union[_Ref, Sequence[_Ref]], timeout: Optional[float] = None) -> Any:
    """The value of a ref, or the values of a list of refs, in order (Ray's ``ray.get``).

    ``timeout`` is in seconds for each ref (``None``: the graph's default for compiled-graph
    refs, for ever for one-off calls). Raises :class:`TaskError` (also an instance of the
    method's own exception type) when a method failed, :class:`GetTimeoutError` on timeout
    (the ref stays valid), :class:`ActorDiedError` when an actor died.
    """
    if type(refs) is CompiledDAGRef:
        return refs.get(timeout)
    if isinstance(refs, (list, tuple)):
        return [get(r, timeout) for r in refs]
    if isinstance(refs, (CompiledDAGRef, ObjectRef, CompiledDAGFuture)):
        return refs.get(timeout)
    raise TypeError(f"adag.get takes refs, or a list of refs, not {type(refs).__name__}")


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
    "TaskError",
    "WrongModeError",
    "exceptions",
    "get",
    "kill",
    "method",
    "remote",
]


__version__ = "0.1.0"


def init(**_options: Any) -> None:
    """Ray's ``ray.init``: accepted so that programs port unchanged. adag needs no cluster:
    actors are worker processes of this interpreter, started by ``.remote()``."""


def shutdown() -> None:
    """Ray's ``ray.shutdown``: tears down every live compiled graph of this process (actor
    processes end when their handles are dropped, and with the interpreter)."""
    from ._dag import _teardown_all

    _teardown_all()


__all__ += ["init", "shutdown", "__version__"]
