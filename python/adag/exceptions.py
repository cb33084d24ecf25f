"""The exceptions of adag, under Ray's names (``ray.exceptions``) and adag's own.

A Ray program catches the same classes it caught with Ray: ``from adag.exceptions import
RayChannelError`` is the class adag raises for a closed channel, and so on. Where adag names
a class of its own, it is either the same object as Ray's (``TaskError is RayTaskError``) or a
subclass of Ray's (``ChannelClosedError`` is a ``RayChannelError``), so ``except`` clauses
written for Ray keep working.

=====================================  ===============================================
adag                                   Ray
=====================================  ===============================================
:class:`AdagError`                     ``RayError`` (the same class)
:class:`TaskError`                     ``RayTaskError`` (the same class; the raised error is
                                       also an instance of the cause's type)
:class:`ActorDiedError`                ``ActorDiedError``, a ``RayActorError``
:class:`GetTimeoutError`               ``GetTimeoutError``; also a ``RayChannelTimeoutError``
                                       (and so a ``RayChannelError`` and a ``TimeoutError``):
                                       every timeout of adag is one class
:class:`CapacityExceededError`         ``RayCgraphCapacityExceeded`` (the same class)
:class:`ChannelClosedError`            a ``RayChannelError`` ("Channel closed.": the graph
                                       was torn down)
:class:`WrongModeError`                the ``ValueError`` of calling ``execute`` on an
                                       ``enable_asyncio`` graph (and the reverse)
:class:`CompileError`                  the ``ValueError`` of an invalid graph or option
:class:`PlacementError`                an actor's placement names no live host (Ray's
                                       actor would stay pending); a ``ValueError``
=====================================  ===============================================
"""

from __future__ import annotations

from typing import Any, Optional


class RayError(Exception):
    """Base class of every error adag raises (Ray's ``RayError``; adag's name:
    :class:`AdagError`)."""


#: adag's name of :class:`RayError`.
AdagError = RayError


class RaySystemError(RayError):
    """A failure of the system rather than of the user's code (Ray's ``RaySystemError``)."""


class RayTaskError(RayError):
    """A method of an actor raised an exception (Ray's ``RayTaskError``; adag's name:
    :class:`TaskError`).

    When the method's own exception could be carried to the driver, the raised error is also
    an instance of that exception's type (as Ray's ``as_instanceof_cause``), so
    ``except ValueError`` catches a ``ValueError`` raised in an actor. ``cause`` is the
    original exception (or ``None`` when it could not be pickled), ``traceback_str`` the
    traceback printed in the actor, with the lines of the actor's source.
    """

    def __init__(
        self,
        actor_name: str,
        method_name: str,
        message: str,
        cause: Optional[BaseException] = None,
        traceback_str: str = "",
    ) -> None:
        if traceback_str:
            text = f"{actor_name}.{method_name}() failed:\n\n{traceback_str.rstrip()}"
        else:
            text = f"{actor_name}.{method_name}() failed: {message}"
        Exception.__init__(self, text)
        self.actor_name = actor_name
        self.method_name = method_name
        self.cause = cause
        self.traceback_str = traceback_str

    @property
    def function_name(self) -> str:
        """The failed method as ``Class.method`` (Ray's attribute)."""
        return f"{self.actor_name}.{self.method_name}"

    def as_instanceof_cause(self) -> "RayTaskError":
        """Ray's method: the error as an instance of its cause's type too. adag raises that
        form already, so this returns the error itself."""
        return self

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # pragma: no cover - pickling an error is rare
        return (
            RayTaskError,
            (self.actor_name, self.method_name, str(self), self.cause, ""),
        )


#: adag's name of :class:`RayTaskError`.
TaskError = RayTaskError


class RayActorError(RayError):
    """An actor is gone (Ray's ``RayActorError``)."""


class ActorDiedError(RayActorError):
    """An actor's worker process died or could not start; its graph was torn down. The
    message starts with Ray's words, "The actor died unexpectedly before finishing this
    task.", then says which actor, where and why."""


class RayChannelError(RaySystemError):
    """A channel of a compiled graph failed or was closed (Ray's ``RayChannelError``)."""

    def __init__(self, client_exc: Any = "Channel closed.", traceback_str: Optional[str] = None):
        super().__init__(str(client_exc))
        self.client_exc = client_exc
        self.traceback_str = traceback_str


class RayChannelTimeoutError(RayChannelError, TimeoutError):
    """A channel operation of a compiled graph ran past its timeout (Ray's
    ``RayChannelTimeoutError``)."""


class GetTimeoutError(RayChannelTimeoutError):
    """A wait ran past its timeout: ``adag.get(ref, timeout=...)``, or submitting past
    ``_submit_timeout``. The message names the option to raise. The ref stays valid (Ray
    uses it up). Ray's ``GetTimeoutError`` and ``RayChannelTimeoutError`` both catch it."""


class RayCgraphCapacityExceeded(RaySystemError):
    """``_max_inflight_executions`` or ``_max_buffered_results`` is reached: get earlier
    results first. Nothing was submitted (Ray's ``RayCgraphCapacityExceeded``; adag's name:
    :class:`CapacityExceededError`)."""


#: adag's name of :class:`RayCgraphCapacityExceeded`.
CapacityExceededError = RayCgraphCapacityExceeded
#: The name of :class:`RayCgraphCapacityExceeded` before Ray 2.44.
RayAdagCapacityExceeded = RayCgraphCapacityExceeded


class ChannelClosedError(RayChannelError):
    """The compiled graph was torn down (explicitly, or because an actor died). The message
    starts with Ray's "Channel closed."."""


class WrongModeError(RayError, ValueError):
    """``execute`` on a graph compiled with ``enable_asyncio=True``, or ``execute_async``
    on one compiled without it."""


class CompileError(RayError, ValueError):
    """The graph or a compile option is not valid; nothing was compiled."""


class PlacementError(RayError, ValueError):
    """An actor is placed (``.options(host=...)`` or a ``NodeAffinitySchedulingStrategy``
    with ``soft=False``) on a host that is not live; nothing was started. The message names
    the actor, the host and the live hosts."""


__all__ = [
    "ActorDiedError",
    "AdagError",
    "CapacityExceededError",
    "ChannelClosedError",
    "CompileError",
    "GetTimeoutError",
    "PlacementError",
    "RayActorError",
    "RayAdagCapacityExceeded",
    "RayCgraphCapacityExceeded",
    "RayChannelError",
    "RayChannelTimeoutError",
    "RayError",
    "RaySystemError",
    "RayTaskError",
    "TaskError",
    "WrongModeError",
]
