"""Ray's ``ray.experimental.channel`` names: the communicator classes
(:mod:`~adag.experimental.channel.communicator`,
:mod:`~adag.experimental.channel.cpu_communicator`), the tensor type hint
(:mod:`~adag.experimental.channel.torch_tensor_type`) and ``CompiledDAGArgs``."""

from typing import Any, Dict, NamedTuple, Tuple

from . import communicator, cpu_communicator, torch_tensor_type
from .communicator import Communicator
from .cpu_communicator import CPUCommunicator
from .torch_tensor_type import TorchTensorType


class CompiledDAGArgs(NamedTuple):
    """The positional and keyword arguments of one execution (Ray's ``CompiledDAGArgs``)."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


__all__ = [
    "CPUCommunicator",
    "Communicator",
    "CompiledDAGArgs",
    "TorchTensorType",
    "communicator",
    "cpu_communicator",
    "torch_tensor_type",
]
