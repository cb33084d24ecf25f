"""Collectives between actors of a graph (Ray's ``ray.experimental.collective``):
``allreduce``, ``allgather``, ``reducescatter``.

Each participant's step is a node on its own actor that reads every participant's input
through the graph's channels (shared memory between processes) and computes the result
itself; values are numpy arrays, torch CPU tensors, or anything with the arithmetic the
operation needs. There is no GPU communicator for Python values: this is the CPU path of
Ray's semantics, with n² transfers (at most 7 participants).
"""

from __future__ import annotations

import enum
import functools
import operator
from typing import Any, List, Sequence

_PREFIX = "__adag_collective__."


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


# The steps, run in the workers (looked up by name by the native actor).


def allreduce(*values: Any, op: str = "sum") -> Any:
    return _reduce(values, op)


def allgather(*values: Any) -> List[Any]:
    return list(values)


def reducescatter(*values: Any, op: str = "sum", rank: int = 0) -> Any:
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
        if len(nodes) > 7:
            raise ValueError(f"{self._name}.bind() takes at most 7 participants in adag's Python API")
        actors = []
        for n in nodes:
            if not isinstance(n, ClassMethodNode):
                raise ValueError(f"{self._name}.bind() takes method nodes (actor.method.bind(...))")
            if any(n._actor is a for a in actors):
                raise ValueError(f"{self._name}.bind(): every input must be on a distinct actor")
            actors.append(n._actor)
        out = []
        for rank, n in enumerate(nodes):
            kwargs = {}
            if self._name != "allgather":
                kwargs["op"] = ReduceOp(op).value
            if self._name == "reducescatter":
                kwargs["rank"] = rank
            out.append(ClassMethodNode(n._actor, _PREFIX + self._name, tuple(nodes), kwargs))
        return out


allreduce_node = _Collective("allreduce")
allgather_node = _Collective("allgather")
reducescatter_node = _Collective("reducescatter")
