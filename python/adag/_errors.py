"""Turning errors into Python exceptions, on both sides of a channel (internal)."""

from __future__ import annotations

import pickle
import re
import traceback
from typing import Any, Optional, Tuple

from . import exceptions as ex

# The Rust option names in adag's messages, as this package spells them.
_OPTIONS = {
    "submit_timeout": "experimental_compile(_submit_timeout=...) (or RAY_CGRAPH_submit_timeout)",
    "get_timeout": "the timeout= of adag.get(ref, timeout=...) (or RAY_CGRAPH_get_timeout)",
    "max_inflight_executions": "experimental_compile(_max_inflight_executions=...)",
    "max_buffered_results": "experimental_compile(_max_buffered_results=...)",
    "buffer_size_bytes": "experimental_compile(_buffer_size_bytes=...)",
    "max_message_bytes": "experimental_compile(_buffer_size_bytes=...)",
    "enable_asyncio": "experimental_compile(enable_asyncio=True)",
}


def _pythonic(message: str) -> str:
    def sub(m: "re.Match[str]") -> str:
        return _OPTIONS.get(m.group(1), m.group(1))

    message = re.sub(r"CompileOptions::(\w+)(\(\.\.\.\)|\(true\))?", sub, message)
    message = message.replace("execute_async(..).await", "await execute_async(...)")
    return message


def format_exception(exc: BaseException) -> str:
    """The exception with its traceback, as Python prints it."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def describe_exception(exc: BaseException, method: str) -> Tuple[str, bytes]:
    """In a worker: the text of method ``method``'s exception, and the pickled details the
    driver rebuilds it from: ``(method, traceback text, the exception or None)``."""
    tb = format_exception(exc)
    text = f"{type(exc).__qualname__}: {exc}"
    try:
        import cloudpickle

        blob = cloudpickle.dumps((method, tb, exc))
        pickle.loads(blob)
    except Exception:
        blob = pickle.dumps((method, tb, None))
    return text, blob


_DUAL: dict = {}


def _dual_class(cause_type: type) -> Optional[type]:
    """``RayTaskError(<cause type>)``: an error that is both (Ray's ``as_instanceof_cause``)."""
    if issubclass(cause_type, ex.TaskError):
        return None
    cls = _DUAL.get(cause_type)
    if cls is None:
        try:
            cls = type(
                f"RayTaskError({cause_type.__name__})",
                (ex.TaskError, cause_type),
                {"__init__": ex.TaskError.__init__, "__str__": ex.TaskError.__str__},
            )
        except TypeError:
            return None
        _DUAL[cause_type] = cls
    return cls


def task_error(actor: str, method: str, text: str, detail: Optional[str]) -> ex.TaskError:
    cause = None
    tb = ""
    if detail:
        try:
            method, tb, cause = pickle.loads(bytes.fromhex(detail))
        except Exception:
            cause = None
    if isinstance(cause, Exception):
        cls = _dual_class(type(cause))
        if cls is not None:
            try:
                err = cls(actor, method, text, cause, tb)
                err.__cause__ = cause
                return err
            except Exception:
                pass
    err = ex.TaskError(actor, method, text, cause, tb)
    if cause is not None:
        err.__cause__ = cause
    return err


#: Ray's own first words for each kind of error, kept so that code matching Ray's text
#: keeps working; adag's explanation (what, where, what to do) follows.
_RAY_WORDS = {
    "actor_died": "The actor died unexpectedly before finishing this task.",
    "closed": "Channel closed.",
}


def _capacity_words(inflight: bool, limit: int) -> str:
    """Ray's text of a ``RayCgraphCapacityExceeded``: the limit was reached, so the count at
    the time equals it."""
    if inflight:
        return (
            f"The compiled graph can't have more than {limit} in-flight executions, and you "
            f"currently have {limit} in-flight executions. Retrieve an output using ray.get "
            "before submitting more requests or increase `_max_inflight_executions`."
        )
    return (
        f"The compiled graph can't have more than {limit} buffered results, and you currently "
        f"have {limit} buffered results. Call `ray.get()` on CompiledDAGRef's (or await on "
        "CompiledDAGFuture's) to retrieve results, or increase `_max_buffered_results` if "
        "buffering is desired, note that this will increase driver memory usage."
    )


def from_native(kind: str, message: str, fields: tuple) -> BaseException:
    """The exception for an error of the native module (see ``driver.rs``, ``to_py_err``)."""
    message = _pythonic(message)
    if kind == "task":
        return task_error(*fields)
    words = _RAY_WORDS.get(kind)
    if kind == "capacity" and fields:
        words = _capacity_words(*fields)
    if words is not None and not message.startswith(words):
        message = f"{words} {message}"
    cls = {
        "actor_died": ex.ActorDiedError,
        "timeout": ex.GetTimeoutError,
        "capacity": ex.CapacityExceededError,
        "closed": ex.ChannelClosedError,
        "wrong_mode": ex.WrongModeError,
        "value": ex.CompileError,
    }.get(kind, ex.AdagError)
    return cls(message)
