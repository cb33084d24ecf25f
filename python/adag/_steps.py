"""adag's own steps, run in the workers as nodes of a graph (a node whose method is
``__adag_step__.NAME`` calls ``NAME`` of this module on the actor's worker): the values of
a method with ``num_returns``, the collectives' steps (:mod:`adag._collective`), and those of
a user's communicator (:mod:`adag._comm_steps`)."""

from typing import Any

from ._collective import allgather, allreduce, pack, reducescatter
from ._comm_steps import comm_collective, comm_destroy, comm_init, comm_recv, comm_send

__all__ = [
    "allgather",
    "allreduce",
    "comm_collective",
    "comm_destroy",
    "comm_init",
    "comm_recv",
    "comm_send",
    "pack",
    "reducescatter",
    "return_value",
]


def return_value(values: Any, index: int) -> Any:
    """Value ``index`` of a method's ``num_returns`` values (the worker checked their
    count when the method returned)."""
    return values[index]
