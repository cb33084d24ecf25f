"""Ray's ``ray.experimental.channel`` names: the communicator classes
(:mod:`~adag.experimental.channel.communicator`,
:mod:`~adag.experimental.channel.cpu_communicator`) and ``CompiledDAGArgs``."""

from typing import Any, Dict, NamedTuple, Tuple

from . import communicator, cpu_communicator
from .communicator import Communicator
from .cpu_communicator import CPUCommunicator


class CompiledDAGArgs(NamedTuple):
    """The positional and keyword arguments of one execution (Ray's ``CompiledDAGArgs``)."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


__all__ = [
    "CPUCommunicator",
    "Communicator",
    "CompiledDAGArgs",
    "communicator",
    "cpu_communicator",
]
