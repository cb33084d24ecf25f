"""Compiling a graph's user communicators (Ray's custom ``Communicator``): which nodes move
their tensors through one, the steps that do it (:mod:`adag._comm_steps`), and each
communicator's set-up and destruction on its actors.

A user's communicator is any :class:`~adag.experimental.channel.communicator.Communicator`
but adag's own ``CPUCommunicator`` (a description of a group: its collectives run as graph
steps over the channels). It is used by

- a collective bound with ``transport=comm``, or without a transport when the graph is
  compiled with ``_default_communicator=comm``;
- a node annotated ``with_tensor_transport(transport=comm)`` (or ``"nccl"`` /
  ``"accelerator"`` with ``_default_communicator=comm``): each reader on another actor
  receives the node's tensors from the communicator, the rest of the value through the
  graph's channel.

The nodes are rewritten in place before the graph is walked: a graph is compiled once, so
nothing else sees them in their first form.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from typing import Any, Dict, List, Optional, Tuple

from ._collective import _PREFIX as STEP_PREFIX
from .exceptions import CompileError

#: A user's communicator (``adag.experimental.channel.communicator.Communicator``); the
#: public package imports this module, so the class is looked up when a graph is compiled.
Communicator = Any

#: How long the communicators' ``initialize`` (every rank at once) and ``destroy`` may take.
INIT_SECONDS = 60.0
DESTROY_SECONDS = 30.0


def is_user_communicator(comm: Any) -> bool:
    """Whether ``comm`` moves tensors itself (anything but adag's ``CPUCommunicator``)."""
    if comm is None or isinstance(comm, str):
        return False
    from .experimental.channel.communicator import Communicator as Base
    from .experimental.channel.cpu_communicator import CPUCommunicator

    return isinstance(comm, Base) and not isinstance(comm, CPUCommunicator)


def group_key(comm: Communicator) -> str:
    """The key a communicator's actors know it by (one per communicator object)."""
    key = comm.__dict__.get("_adag_group_key")
    if key is None:
        key = uuid.uuid4().hex
        comm.__dict__["_adag_group_key"] = key
    return key


def _rank(comm: Communicator, actor: Any, what: str) -> int:
    try:
        return comm.get_rank(actor)
    except Exception as e:
        raise CompileError(
            f"{what}: actor {getattr(actor, '_actor_name', actor)} is not in the communicator "
            f"{type(comm).__name__} (its actors: "
            f"{[getattr(a, '_actor_name', a) for a in comm.get_actor_handles()]}): {e}"
        ) from e


def _unregister(node: Any) -> None:
    """Drop ``node`` from the consumers of its arguments, and the collective's packs that
    only it read (they would be leaves of the graph)."""
    for d in node._deps():
        d._consumers[:] = [c for c in d._consumers if c is not node]
        if getattr(d, "_method", "").endswith(".pack") and not d._consumers:
            _unregister(d)


def _replace_arg(node: Any, old: Any, new: Any) -> None:
    node._args = tuple(new if a is old else a for a in node._args)
    node._kwargs = {k: (new if v is old else v) for k, v in node._kwargs.items()}
    old._consumers[:] = [c for c in old._consumers if c is not node]
    new._add_consumer(node)


def _transport_of(node: Any) -> Any:
    """The node's communicator (its type hint's custom one), else its transport's name."""
    hint = getattr(node, "_type_hint", None)
    if hint is None:
        return None
    custom = hint.get_custom_communicator()
    return custom if custom is not None else hint.transport


def upstream(outputs: List[Any]) -> List[Any]:
    """Every node the ``outputs`` read, directly or not."""
    seen: Dict[int, Any] = {}
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen[id(n)] = n
            stack.extend(n._deps())
    return list(seen.values())


def plan(nodes: List[Any], default: Any) -> Dict[str, Communicator]:
    """Rewrite the collectives and tensor edges of ``nodes`` (every node that reaches the
    output) that a user's communicator serves; the communicators used, by group key."""
    used: Dict[str, Communicator] = {}
    default_comm = default if is_user_communicator(default) else None
    for node in list(nodes):
        info = getattr(node, "_collective", None)
        if info is None:
            continue
        kind, op, rank, inputs, transport = info
        comm = transport if is_user_communicator(transport) else None
        if comm is None and transport is None:
            comm = default_comm
        if comm is None:
            continue
        key = group_key(comm)
        used[key] = comm
        if node._method != STEP_PREFIX + "comm_collective":
            _unregister(node)
            node._method = STEP_PREFIX + "comm_collective"
            node._args = (inputs[rank],)
            node._kwargs = {"kind": kind, "op": op, "key": key}
            inputs[rank]._add_consumer(node)
    for writer in list(nodes):
        if not hasattr(writer, "_actor"):
            continue
        transport = _transport_of(writer)
        comm = transport if is_user_communicator(transport) else None
        if comm is None and transport == "accelerator":
            comm = default_comm
        if comm is None:
            continue
        _split_edge(writer, comm, used)
    return used


def _split_edge(writer: Any, comm: Communicator, used: Dict[str, Communicator]) -> None:
    """The readers of ``writer`` on other actors receive its tensors from ``comm``: a send
    step on the writer's actor right after it, a receive step on each reader's actor right
    before its first reader there."""
    name = f"{writer._actor._actor_name}.{writer._label}"
    readers = [c for c in writer._consumers if c is not writer]
    if any(not hasattr(c, "_actor") for c in readers):
        raise CompileError(
            f"the output of {name} has a communicator transport, but the driver reads it: the "
            "driver cannot participate in a communicator group; drop the transport, or read it "
            "through an actor method"
        )
    remote: Dict[int, Tuple[Any, List[Any]]] = {}
    for c in readers:
        if c._actor is writer._actor:
            continue  # read in the actor itself: no communicator between them
        remote.setdefault(id(c._actor), (c._actor, []))[1].append(c)
    if not remote:
        return
    key = group_key(comm)
    used[key] = comm
    what = f"the tensor edge from {name}"
    me = _rank(comm, writer._actor, what)
    peers = {id(a): _rank(comm, a, what) for a, _ in remote.values()}
    make = type(writer)
    send = make(
        writer._actor,
        STEP_PREFIX + "comm_send",
        (writer,),
        {"key": key, "peers": sorted(set(peers.values()))},
        label=f"{writer._label}.send",
    )
    send._bind_index = writer._bind_index + 0.5
    for actor, consumers in remote.values():
        recv = make(
            actor,
            STEP_PREFIX + "comm_recv",
            (send,),
            {"key": key, "peer": me},
            label=f"{writer._label}.recv",
        )
        recv._bind_index = min(c._bind_index for c in consumers) - 0.25
        for c in consumers:
            _replace_arg(c, writer, recv)


def _wait_all(calls: List[Tuple[Any, Any]], seconds: float, verb: str) -> Optional[str]:
    """Wait for one-off calls ``(actor, ref)`` at most ``seconds`` in all; the first
    failure, in words, naming its actor."""
    futures = {ref.future(): actor for actor, ref in calls}
    done, pending = concurrent.futures.wait(futures, timeout=seconds)
    for f in done:
        e = f.exception()
        if e is not None:
            return f"{verb} failed on actor {futures[f]._actor_name}: {e}"
    if pending:
        names = sorted(futures[f]._actor_name for f in pending)
        return f"{verb} did not finish within {seconds:g} s on actors {names}"
    return None


def initialize(groups: Dict[str, Communicator]) -> None:
    """Each communicator's ``initialize(rank)`` on each of its actors, every rank at once."""
    import cloudpickle

    for key, comm in groups.items():
        blob = cloudpickle.dumps(comm)
        calls = []
        for actor in comm.get_actor_handles():
            rank = _rank(comm, actor, f"initializing {type(comm).__name__}")
            calls.append(
                (actor, actor._submit(STEP_PREFIX + "comm_init", (blob, key, rank), {}))
            )
        failed = _wait_all(calls, INIT_SECONDS, f"{type(comm).__name__}.initialize(rank)")
        if failed is not None:
            destroy({key: comm})
            raise CompileError(
                f"{failed}: each actor of a communicator must initialize it (all ranks at once)"
            )


def destroy(groups: Dict[str, Communicator]) -> Optional[str]:
    """Each communicator's ``destroy()`` on each of its actors (after its sends in flight);
    the first failure in words, if any."""
    failed = None
    for key, comm in groups.items():
        calls = [
            (a, a._submit(STEP_PREFIX + "comm_destroy", (key,), {}))
            for a in comm.get_actor_handles()
        ]
        failed = failed or _wait_all(calls, DESTROY_SECONDS, f"{type(comm).__name__}.destroy()")
    return failed
