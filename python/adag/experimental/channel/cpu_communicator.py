"""Ray's ``ray.experimental.channel.cpu_communicator``: ``CPUCommunicator``.

A group of actors on CPUs. adag moves their values through the graph's own channels and runs
collectives as steps on each actor (:mod:`adag.collective`), so the communicator is the
group's description: its actors in rank order, checked against the collectives that use it.
"""

from __future__ import annotations

from typing import Any, List, Optional

from .communicator import Communicator


class CPUCommunicator(Communicator):
    """The actors of a collective or a tensor edge on CPUs (Ray's ``CPUCommunicator``):
    ``CPUCommunicator(world_size, actor_handles)``, ranks in the order given."""

    def __init__(self, world_size: int, actor_handles: List[Any]) -> None:
        if world_size != len(actor_handles):
            raise ValueError(
                f"CPUCommunicator(world_size={world_size}) was given {len(actor_handles)} "
                "actors: pass one actor per rank"
            )
        self._world_size = world_size
        self._actor_handles = list(actor_handles)
        self._rank: Optional[int] = None

    def initialize(self, rank: int) -> None:
        self._rank = rank

    def get_actor_handles(self) -> List[Any]:
        return list(self._actor_handles)

    def get_rank(self, actor: Any) -> int:
        for i, a in enumerate(self._actor_handles):
            if a is actor or getattr(a, "_actor_name", None) == getattr(actor, "_actor_name", object()):
                return i
        raise ValueError("Actor is not in the CPUCommunicator group.")

    def get_self_rank(self) -> Optional[int]:
        return self._rank

    def get_world_size(self) -> int:
        return self._world_size

    def get_transport_name(self) -> str:
        return "cpu"

    def _unused(self, what: str) -> Any:
        raise NotImplementedError(
            f"CPUCommunicator.{what}: adag moves the values of a graph through its own "
            "channels and runs collectives as graph steps; bind adag.experimental.collective "
            "operations instead of calling the communicator"
        )

    def send(self, value: Any, peer_rank: int) -> None:
        self._unused("send")

    def recv(self, shape: Any, dtype: Any, peer_rank: int, allocator: Any = None) -> Any:
        return self._unused("recv")

    def allreduce(self, send_buf: Any, recv_buf: Any, op: Any = None) -> None:
        self._unused("allreduce")

    def allgather(self, send_buf: Any, recv_buf: Any) -> None:
        self._unused("allgather")

    def reducescatter(self, send_buf: Any, recv_buf: Any, op: Any = None) -> None:
        self._unused("reducescatter")

    def destroy(self) -> None:
        return None


__all__ = ["CPUCommunicator"]
