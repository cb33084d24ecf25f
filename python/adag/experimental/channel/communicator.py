"""Ray's ``ray.experimental.channel.communicator``: the ``Communicator`` base class.

In adag's Python package every value travels through the graph's channels (shared memory on
a host, TCP between hosts) and collectives run as steps on each participant's actor
(:mod:`adag.collective`), so a communicator describes a group of actors: which actors, in
which rank order. Passing one to ``with_tensor_transport(transport=comm)``,
``allreduce.bind(nodes, transport=comm)`` or ``experimental_compile(_default_communicator=
comm)`` is accepted and checked (a collective's actors must be the communicator's); its data
methods (``send``, ``recv``, ``allreduce``, ...) are not called by adag.
"""

from __future__ import annotations

import abc
from typing import Any, List, Optional


class Communicator(abc.ABC):
    """A group of actors that exchange tensors (Ray's ``Communicator``)."""

    @abc.abstractmethod
    def initialize(self, rank: int) -> None: ...

    @abc.abstractmethod
    def get_actor_handles(self) -> List[Any]: ...

    @abc.abstractmethod
    def get_rank(self, actor: Any) -> int: ...

    @abc.abstractmethod
    def get_self_rank(self) -> Optional[int]: ...

    def get_world_size(self) -> int:
        raise NotImplementedError

    @abc.abstractmethod
    def send(self, value: Any, peer_rank: int) -> None: ...

    @abc.abstractmethod
    def recv(self, shape: Any, dtype: Any, peer_rank: int, allocator: Any = None) -> Any: ...

    @abc.abstractmethod
    def allreduce(self, send_buf: Any, recv_buf: Any, op: Any = None) -> None: ...

    @abc.abstractmethod
    def destroy(self) -> None: ...

    @abc.abstractmethod
    def get_transport_name(self) -> str: ...

    @property
    def recv_stream(self) -> Any:
        raise NotImplementedError

    @property
    def send_stream(self) -> Any:
        raise NotImplementedError


__all__ = ["Communicator"]
