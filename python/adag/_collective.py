"""Collectives between actors of a graph (Ray's ``ray.experimental.collective``):
``allreduce``, ``allgather``, ``reducescatter``.

Each participant's step is a node on its own actor that reads every participant's input
through the graph's channels (shared memory between processes) and computes the result
itself; values are numpy arrays, torch CPU tensors, or anything with the arithmetic the
operation needs. There is no GPU communicator for Python values: this is the CPU path of
Ray's semantics, with n² transfers.

A node takes at most 7 node arguments (the native actor's ``call0`` .. ``call7``): with more
than 7 participants, each participant's step reads them through *packs*, nodes on its own
actor that each gather up to 7 inputs (nested as deep as needed), so any number of
participants works (one in-actor hop per level of packs).
"""

from __future__ import annotations

import enum
import functools
import operator
from typing import Any, List, Sequence

#: Collective steps run from `adag._steps` (see `adag._dag.STEP_PREFIX`).
_PREFIX = "__adag_step__."


class ReduceOp(enum.Enum):
    """The reduction of ``allreduce`` and ``reducescatter`` (Ray's ``ReduceOp``)."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


def _elementwise(name: str, a: Any, b: Any) -> Any:
    mod = type(a).__module__.split(".")[0]
    if mod == "numpy":
        import numpy as np

        return getattr(np, "maximum" if name == "max" else "minimum")(a, b)
    if mod == "torch":
        import torch

        return getattr(torch, "maximum" if name == "max" else "minimum")(a, b)
    return max(a, b) if name == "max" else min(a, b)


def _reduce(values: Sequence[Any], op: str) -> Any:
    if op in ("sum", "avg"):
        out = functools.reduce(operator.add, values)
        return out / len(values) if op == "avg" else out
    if op == "product":
        return functools.reduce(operator.mul, values)
    return functools.reduce(lambda a, b: _elementwise(op, a, b), values)


#: The most node arguments one bound call takes (`MAX_NODE_ARGS` of the native actor).
_MAX_NODE_ARGS = 7


class _Pack(tuple):
    """Inputs of a collective gathered by a pack node (see the module doc)."""

    __slots__ = ()


def _flat(values: Sequence[Any]) -> List[Any]:
    """The participants' inputs in rank order, packs opened."""
    out: List[Any] = []
    for v in values:
        if type(v) is _Pack:
            out.extend(_flat(v))
        else:
            out.append(v)
    return out


# The steps, run in the workers (looked up by name by the native actor).


def pack(*values: Any) -> _Pack:
    return _Pack(values)


def allreduce(*values: Any, op: str = "sum") -> Any:
    return _reduce(_flat(values), op)


def allgather(*values: Any) -> List[Any]:
    return _flat(values)


def reducescatter(*values: Any, op: str = "sum", rank: int = 0) -> Any:
    values = _flat(values)
    total = _reduce(values, op)
    n = len(values)
    try:
        import numpy as np

        if isinstance(total, np.ndarray):
            return np.array_split(total, n)[rank]
    except ImportError:  # pragma: no cover
        pass
    if type(total).__module__.split(".")[0] == "torch":
        return total.tensor_split(n)[rank]
    size = len(total)
    return total[rank * size // n : (rank + 1) * size // n]


class _Collective:
    def __init__(self, name: str) -> None:
        self._name = name

    def bind(self, inputs: Sequence[Any], op: ReduceOp = ReduceOp.SUM, transport: Any = None) -> List[Any]:
        """One node per input, on the input's actor, each the collective's result for that
        participant. ``inputs`` are method nodes of distinct actors."""
        from ._dag import ClassMethodNode

        nodes = list(inputs)
        if not nodes:
            raise ValueError(f"{self._name}.bind() needs at least one input node")
        if not isinstance(op, ReduceOp):
            raise ValueError(f"Unexpected operation: {op}")
        actors = []
        for n in nodes:
            if not isinstance(n, ClassMethodNode):
                raise ValueError(f"{self._name}.bind() takes method nodes (actor.method.bind(...))")
            if any(n._actor is a for a in actors):
                raise ValueError(
                    "Expected unique actor handles for a collective operation, but found "
                    "duplicate actor handles from input nodes: "
                    f"{[m._actor._actor_name for m in nodes]}. adag: {self._name}.bind() takes "
                    f"one node per participant, each on a distinct actor ({n._actor._actor_name} "
                    "appears twice)"
                )
            actors.append(n._actor)
        if transport is not None and not isinstance(transport, str):
            members = transport.get_actor_handles()
            names = sorted(getattr(a, "_actor_name", str(a)) for a in members)
            ours = sorted(a._actor_name for a in actors)
            if names != ours:
                raise ValueError(
                    "Expected actor handles to match the custom communicator group. "
                    "The passed-in communicator must have the same set of actors as the "
                    f"collective operation. The passed-in communicator has actors {names} "
                    f"while the collective operation has actors {ours}."
                )
        from ._comm_plan import group_key, is_user_communicator

        out = []
        label = self._name if self._name == "allgather" else f"{self._name}.{ReduceOp(op).name.lower()}"
        for rank, n in enumerate(nodes):
            if is_user_communicator(transport):
                # The communicator runs it: each rank's step reads its own input only.
                node = ClassMethodNode(
                    n._actor,
                    _PREFIX + "comm_collective",
                    (n,),
                    {"kind": self._name, "op": ReduceOp(op).value, "key": group_key(transport)},
                    label=label,
                )
            else:
                kwargs = {}
                if self._name != "allgather":
                    kwargs["op"] = ReduceOp(op).value
                if self._name == "reducescatter":
                    kwargs["rank"] = rank
                args = _packed(n._actor, nodes)
                node = ClassMethodNode(
                    n._actor, _PREFIX + self._name, tuple(args), kwargs, label=label
                )
            # What compiling needs to hand it to a communicator (`adag._comm_plan`).
            node._collective = (self._name, ReduceOp(op).value, rank, nodes, transport)
            out.append(node)
        return out


def _packed(actor: Any, nodes: Sequence[Any]) -> List[Any]:
    """Node arguments for a step on ``actor`` that carry every node of ``nodes``: the nodes
    themselves when there are at most 7, else pack nodes on ``actor`` (nested as needed)."""
    from ._dag import ClassMethodNode

    level = list(nodes)
    while len(level) > _MAX_NODE_ARGS:
        level = [
            ClassMethodNode(
                actor, _PREFIX + "pack", tuple(level[i : i + _MAX_NODE_ARGS]), {}, label="pack"
            )
            for i in range(0, len(level), _MAX_NODE_ARGS)
        ]
    return level


allreduce_node = _Collective("allreduce")
allgather_node = _Collective("allgather")
reducescatter_node = _Collective("reducescatter")
