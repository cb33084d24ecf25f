"""The steps of a user's communicator, run in the workers (Ray's custom ``Communicator``).

A ``Communicator`` passed as ``with_tensor_transport(transport=comm)``,
``allreduce.bind(nodes, transport=comm)`` or ``experimental_compile(_default_communicator=
comm)`` is what moves the tensors: at compile, each of its actors unpickles its own copy and
calls ``initialize(rank)`` (all ranks at once: a ``torch.distributed`` group needs every rank
to join), then the graph's steps call it as Ray does:

- a collective's step calls ``allreduce(send_buf, recv_buf, op)`` (``allgather``,
  ``reducescatter``) on its own input, into a buffer it allocates (``torch.empty_like``, or the
  gathered/scattered shape);
- a tensor edge becomes two steps: on the writer's actor, :func:`comm_send` takes the tensors
  out of the value (at any depth of tuples, lists and dicts), returns their shapes and dtypes
  with the rest of the value (which travels through the graph's channel, as Ray's metadata
  does), and sends each tensor to each reader with ``send(tensor, peer_rank)`` on a thread of
  its own, so that the reader can post its receive after reading the metadata (a blocking send
  issued before the metadata would wait for ever); on the reader's actor, :func:`comm_recv`
  reads the metadata and calls ``recv(shape, dtype, peer_rank)`` for each tensor.

Sends of one group keep their order (one sending thread per group); the next send of an edge
waits for the previous one, so a sent tensor is not reused while in flight, and a failed send
fails the next step that sends, or the teardown, naming the group.
"""

from __future__ import annotations

import concurrent.futures
import pickle
from typing import Any, Dict, List, Optional, Tuple

from ._collective import ReduceOp

#: This worker's initialized communicators, by the group key the driver gave them.
_groups: Dict[str, Any] = {}
#: One sending thread per group, and the last send submitted to it.
_senders: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_in_flight: Dict[str, "concurrent.futures.Future[None]"] = {}

#: How long the teardown waits for the sends still in flight.
_DRAIN_SECONDS = 30.0


class _Slot:
    """Where the ``i``-th tensor of a value went (the metadata travels without it)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Any:
        return (_Slot, (self.index,))


def _group(key: str) -> Any:
    comm = _groups.get(key)
    if comm is None:
        raise RuntimeError(
            f"communicator group {key} is not initialized in this actor: it was destroyed (the "
            "graph was torn down), or its initialize() failed at compile"
        )
    return comm


def comm_init(blob: bytes, key: str, rank: int) -> int:
    """Unpickle the driver's communicator and ``initialize(rank)`` it in this actor."""
    comm = pickle.loads(blob)
    comm.initialize(rank)
    _groups[key] = comm
    return rank


def comm_destroy(key: str) -> None:
    """Wait (bounded) for the group's sends in flight, then ``destroy()`` it."""
    comm = _groups.pop(key, None)
    sender = _senders.pop(key, None)
    last = _in_flight.pop(key, None)
    failure: Optional[BaseException] = None
    if last is not None:
        try:
            last.result(timeout=_DRAIN_SECONDS)
        except BaseException as e:  # reported after the destroy
            failure = e
    if sender is not None:
        sender.shutdown(wait=False)
    if comm is not None:
        comm.destroy()
    if failure is not None:
        raise RuntimeError(f"a send of communicator group {key} failed: {failure}") from failure


def _torch() -> Any:
    import torch

    return torch


def comm_collective(value: Any, kind: str, op: str, key: str) -> Any:
    """One rank's part of a collective through the group's communicator."""
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            "Expected a torch tensor for each input node: a collective through a "
            f"communicator moves torch tensors, and this rank's input is a {type(value).__name__}"
        )
    comm = _group(key)
    world = comm.get_world_size()
    if kind == "allreduce":
        recv = torch.empty_like(value)
        comm.allreduce(value, recv, ReduceOp(op))
        return recv
    if kind == "allgather":
        recv = torch.empty(
            (world * value.shape[0], *value.shape[1:]), dtype=value.dtype, device=value.device
        )
        comm.allgather(value, recv)
        return recv
    if kind == "reducescatter":
        if value.shape[0] % world:
            raise ValueError(
                "Expected the first dimension of the input tensor to be divisible by the "
                f"world size {world}"
            )
        recv = torch.empty(
            (value.shape[0] // world, *value.shape[1:]), dtype=value.dtype, device=value.device
        )
        comm.reducescatter(value, recv, ReduceOp(op))
        return recv
    raise ValueError(f"no collective named {kind}")


def _take_tensors(value: Any, out: List[Any], torch: Any) -> Any:
    """``value`` with each tensor (at any depth of tuples, lists and dicts) replaced by its
    :class:`_Slot`; the tensors appended to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
        return _Slot(len(out) - 1)
    if type(value) in (tuple, list):
        return type(value)(_take_tensors(v, out, torch) for v in value)
    if type(value) is dict:
        return {k: _take_tensors(v, out, torch) for k, v in value.items()}
    return value


def _put_tensors(value: Any, tensors: List[Any]) -> Any:
    if type(value) is _Slot:
        return tensors[value.index]
    if type(value) in (tuple, list):
        return type(value)(_put_tensors(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _put_tensors(v, tensors) for k, v in value.items()}
    return value


def comm_send(value: Any, key: str, peers: List[int]) -> Tuple[Any, List[Tuple[tuple, Any]]]:
    """The writer's half of a tensor edge: sends the value's tensors to each peer rank (on
    the group's sending thread) and returns the rest of the value with their metadata."""
    torch = _torch()
    comm = _group(key)
    tensors: List[Any] = []
    rest = _take_tensors(value, tensors, torch)
    last = _in_flight.get(key)
    if last is not None:
        # In order, and never more than one execution's tensors in flight per group.
        last.result()
    tensors = [t.contiguous() for t in tensors]

    def send() -> None:
        for peer in peers:
            for t in tensors:
                comm.send(t, peer)

    sender = _senders.get(key)
    if sender is None:
        sender = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"adag-comm-send-{key[:8]}"
        )
        _senders[key] = sender
    _in_flight[key] = sender.submit(send)
    return rest, [(tuple(t.shape), t.dtype) for t in tensors]


def comm_recv(message: Tuple[Any, List[Tuple[tuple, Any]]], key: str, peer: int) -> Any:
    """The reader's half of a tensor edge: receives each tensor the metadata announces from
    ``peer`` and puts them back into the value."""
    rest, meta = message
    comm = _group(key)
    tensors = [comm.recv(shape, dtype, peer) for shape, dtype in meta]
    return _put_tensors(rest, tensors)
