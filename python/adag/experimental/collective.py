"""Ray's ``ray.experimental.collective``: ``allreduce.bind(nodes, op=ReduceOp.SUM,
transport=None)``, ``allgather.bind(nodes)``, ``reducescatter.bind(nodes, op=...)``; the same
objects as :mod:`adag.collective`."""

from .._collective import ReduceOp
from .._collective import allgather_node as allgather
from .._collective import allreduce_node as allreduce
from .._collective import reducescatter_node as reducescatter

__all__ = ["ReduceOp", "allgather", "allreduce", "reducescatter"]
