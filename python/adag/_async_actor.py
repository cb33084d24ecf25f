"""Async actors (Ray's ``async def`` methods), in the worker.

An actor whose class defines an ``async def`` method gets an event loop of its own, running on
a thread of its worker from the moment its class is loaded (before the constructor, which
finds it as the thread's event loop: ``asyncio.Event()``, ``asyncio.get_event_loop()``).

- As a graph task, an ``async def`` method runs on that loop and the task waits for its
  result: the actor's tasks of one execution stay in bind order, as Ray's do.
- As one-off calls, ``async def`` methods run concurrently, up to the actor's
  ``max_concurrency`` (Ray's default for async actors, 1000): the driver starts each with
  :func:`start`, which returns its result if it finished within a short wait, else a ticket,
  and asks again with :func:`poll` until it is done. Between two asks the actor's thread is
  free for other calls, so one call can wait on an ``asyncio.Event`` that a later call sets
  (Ray's ``SignalActor``).

Sync methods of such an actor run on its loop too (the caller waits for them), as in Ray:
what they do to the actor's ``asyncio`` objects (``event.set()``) wakes the coroutines that
wait on them, and the actor's state is touched by one thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import threading
from typing import Any, Dict, Tuple

#: How long one ask waits for a coroutine before it answers with a ticket (seconds): a short
#: call answers at once; a long one costs a call every so often, and holds the actor's thread
#: no longer than this.
ASK_SECONDS = 0.02

_loop: "asyncio.AbstractEventLoop | None" = None
_loop_thread: "threading.Thread | None" = None
_lock = threading.Lock()
_tickets: Dict[int, "concurrent.futures.Future[Any]"] = {}
_numbers = itertools.count(1)


def loop() -> asyncio.AbstractEventLoop:
    """This worker's actor event loop, started on first use."""
    global _loop, _loop_thread
    with _lock:
        if _loop is None:
            new = asyncio.new_event_loop()
            _loop_thread = threading.Thread(
                target=new.run_forever, name="adag-actor-loop", daemon=True
            )
            _loop_thread.start()
            _loop = new
        return _loop


def is_async(cls: type) -> bool:
    """Whether ``cls`` defines an ``async def`` method (an async actor, in Ray's terms)."""
    return any(
        inspect.iscoroutinefunction(getattr(cls, name, None))
        for name in dir(cls)
        if not (name.startswith("__") and name.endswith("__"))
    )


def _on_loop(fn: Any) -> Any:
    """``fn`` (a sync method of an async actor) run on the actor's loop, the caller waiting:
    what it does to the actor's ``asyncio`` objects (``event.set()``) happens where their
    waiters run, as in Ray, where an async actor's methods all run on its loop."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is _loop_thread:
            return fn(self, *args, **kwargs)
        done: "concurrent.futures.Future[Any]" = concurrent.futures.Future()

        def go() -> None:
            try:
                done.set_result(fn(self, *args, **kwargs))
            except BaseException as e:  # the method's own error, for its caller
                done.set_exception(e)

        loop().call_soon_threadsafe(go)
        return done.result()

    return call


def prepare(cls: type) -> None:
    """In a worker, before the constructor of an async actor: its loop is the thread's event
    loop, its sync methods run on that loop, and its class answers the driver's
    :func:`start` and :func:`poll`."""
    asyncio.set_event_loop(loop())
    for name in dir(cls):
        if name.startswith("__") and name.endswith("__"):
            continue
        attr = inspect.getattr_static(cls, name, None)
        if inspect.isfunction(attr) and not inspect.iscoroutinefunction(attr):
            setattr(cls, name, _on_loop(attr))
    cls.__adag_async_start__ = start  # type: ignore[attr-defined]
    cls.__adag_async_poll__ = poll  # type: ignore[attr-defined]


def run(coroutine: Any) -> Any:
    """Run ``coroutine`` on the actor's loop and wait for its result (a graph task)."""
    return asyncio.run_coroutine_threadsafe(coroutine, loop()).result()


def _answer(future: "concurrent.futures.Future[Any]") -> Tuple[str, Any]:
    try:
        return ("done", future.result(timeout=ASK_SECONDS))
    except concurrent.futures.TimeoutError:
        ticket = next(_numbers)
        _tickets[ticket] = future
        return ("pending", ticket)


def start(self: Any, method: str, args: tuple, kwargs: Dict[str, Any]) -> Tuple[str, Any]:
    """A one-off call of ``method``: ``("done", result)``, or ``("pending", ticket)`` while
    its coroutine runs on the loop."""
    result = getattr(self, method)(*args, **kwargs)
    if not inspect.iscoroutine(result):
        return ("done", result)
    return _answer(asyncio.run_coroutine_threadsafe(result, loop()))


def poll(self: Any, ticket: int) -> Tuple[str, Any]:
    """Ask again about a call that was pending."""
    future = _tickets.pop(ticket)
    if future.done():
        return ("done", future.result())
    return _answer(future)
