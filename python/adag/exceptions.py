"""The exceptions of adag, with the meaning of Ray's (``ray.exceptions``).

=====================================  ===============================================
adag                                   Ray
=====================================  ===============================================
:class:`AdagError`                     ``RayError``
:class:`TaskError`                     ``RayTaskError`` (also an instance of the cause's type)
:class:`ActorDiedError`                ``ActorDiedError`` / ``RayActorError``
:class:`GetTimeoutError`               ``GetTimeoutError`` / ``RayChannelTimeoutError``
:class:`CapacityExceededError`         ``RayCgraphCapacityExceeded``
:class:`ChannelClosedError`            ``RayChannelError`` (the graph was torn down)
:class:`WrongModeError`                the ``ValueError`` of calling ``execute`` on an
                                       ``enable_asyncio`` graph (and the reverse)
:class:`CompileError`                  the ``ValueError`` of an invalid graph or option
:class:`PlacementError`                an actor's placement names no live host (Ray's
                                       actor would stay pending)
=====================================  ===============================================
"""

from __future__ import annotations

from typing import Optional


class AdagError(Exception):
    """Base class of every error adag raises (Ray's ``RayError``)."""


class TaskError(AdagError):
    """A method of an actor raised an exception (Ray's ``RayTaskError``).

    When the method's own exception could be carried to the driver, the raised error is also
    an instance of that exception's type (as Ray's ``as_instanceof_cause``), so
    ``except ValueError`` catches a ``ValueError`` raised in an actor. ``cause`` is the
    original exception (or ``None`` when it could not be pickled), ``traceback_str`` the
    traceback printed in the actor.
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

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # pragma: no cover - pickling an error is rare
        return (TaskError, (self.actor_name, self.method_name, str(self), self.cause, ""))


class ActorDiedError(AdagError):
    """An actor's worker process died or could not start; its graph was torn down."""


class GetTimeoutError(AdagError, TimeoutError):
    """A wait ran past its timeout: ``adag.get(ref, timeout=...)`` or submitting with
    ``_submit_timeout``. The message names the option to raise. The ref stays valid."""


class CapacityExceededError(AdagError):
    """``_max_inflight_executions`` or ``_max_buffered_results`` is reached: get earlier
    results first. Nothing was submitted."""


class ChannelClosedError(AdagError):
    """The compiled graph was torn down (explicitly, or because an actor died)."""


class WrongModeError(AdagError, ValueError):
    """``execute`` on a graph compiled with ``enable_asyncio=True``, or ``execute_async``
    on one compiled without it."""


class CompileError(AdagError, ValueError):
    """The graph or a compile option is not valid; nothing was compiled."""


class PlacementError(AdagError, ValueError):
    """An actor is placed (``.options(host=...)`` or a ``NodeAffinitySchedulingStrategy``
    with ``soft=False``) on a host that is not live; nothing was started. The message names
    the actor, the host and the live hosts."""


__all__ = [
    "AdagError",
    "TaskError",
    "ActorDiedError",
    "GetTimeoutError",
    "CapacityExceededError",
    "ChannelClosedError",
    "WrongModeError",
    "CompileError",
    "PlacementError",
]
