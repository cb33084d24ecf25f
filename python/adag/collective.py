"""Collectives (Ray's ``ray.experimental.collective``): ``allreduce.bind(nodes, op=...)``,
``allgather.bind(nodes)``, ``reducescatter.bind(nodes, op=...)``; each returns one node per
input, on that input's actor. CPU values (numpy arrays, torch CPU tensors); see
:mod:`adag._collective` for how they run."""

from ._collective import ReduceOp
from ._collective import allgather_node as allgather
from ._collective import allreduce_node as allreduce
from ._collective import reducescatter_node as reducescatter

__all__ = ["ReduceOp", "allgather", "allreduce", "reducescatter"]
