"""Ray's ``ray.experimental.util.types``: ``ReduceOp`` (the same class as
:class:`adag.collective.ReduceOp`) and ``Device``."""

import enum

from ..._collective import ReduceOp


class Device(enum.Enum):
    """Where a received tensor is placed (Ray's ``Device``); adag's Python values always
    arrive in host memory."""

    DEFAULT = "default"
    CPU = "cpu"
    GPU = "gpu"
    CUDA = "cuda"


__all__ = ["Device", "ReduceOp"]
