"""Ray's ``ray.experimental.util.types``: ``ReduceOp`` (the same class as
:class:`adag.collective.ReduceOp`) and ``Device``."""

import enum

from ..._collective import ReduceOp


class Device(enum.Enum):
    """Where a received tensor is placed (Ray's ``Device``): ``DEFAULT`` the sender's device
    type, ``CPU`` host memory, ``GPU``/``CUDA`` the reader's current CUDA device
    (``with_tensor_transport(device=...)``, :class:`~adag.experimental.channel.torch_tensor_type.TorchTensorType`)."""

    DEFAULT = "default"
    CPU = "cpu"
    GPU = "gpu"
    CUDA = "cuda"


__all__ = ["Device", "ReduceOp"]
