"""Actors: ``@adag.remote`` classes, their handles, methods and one-off calls (internal;
the names are exported by :mod:`adag`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import sys
import threading
from typing import Any, Dict, Generic, Optional, TypeVar

from . import _native
from .exceptions import GetTimeoutError

T = TypeVar("T")

_worker_command_set = False
_numbers = itertools.count(1)
_lock = threading.Lock()

# `.options(...)` keywords of Ray's that adag does not use: accepted, so that a Ray program
# ports unchanged (`scheduling_strategy` places the actor, see `cluster.placement`).
_RAY_OPTIONS = {
    "num_cpus",
    "num_gpus",
    "resources",
    "memory",
    "scheduling_strategy",
    "max_concurrency",
    "max_restarts",
    "max_task_retries",
    "lifetime",
    "namespace",
    "runtime_env",
    "concurrency_groups",
    "get_if_exists",
    "placement_group",
    "placement_group_bundle_index",
    "accelerator_type",
    "label_selector",
}


def _ensure_worker_command() -> None:
    """Workers are this interpreter, importing this very build of the package."""
    global _worker_command_set
    with _lock:
        if _worker_command_set:
            return
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (
            f"import sys; sys.path.insert(0, {root!r}); "
            "import adag._native as m; m._worker_main()"
        )
        _native._set_worker_command(sys.executable, ["-u", "-c", code])
        _worker_command_set = True


class ObjectRef(Generic[T]):
    """The result of a one-off call ``actor.method.remote(...)`` (Ray's ``ObjectRef``):
    claim it with :func:`adag.get` or ``await`` it."""

    def __init__(self, future: "concurrent.futures.Future[T]") -> None:
        self._future = future

    def get(self, timeout: Optional[float] = None) -> T:
        """Wait for the value, up to ``timeout`` seconds (``None``: for ever)."""
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise GetTimeoutError(
                f"timed out after {timeout} s waiting for a one-off call; "
                "raise the timeout= of adag.get(ref, timeout=...)"
            ) from None

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def future(self) -> "concurrent.futures.Future[T]":
        """The call as a ``concurrent.futures.Future``."""
        return self._future


class ActorMethod:
    """A method of an actor: ``.bind(...)`` adds it to a graph, ``.remote(...)`` calls it
    once."""

    def __init__(self, actor: "ActorHandle", name: str) -> None:
        self._actor = actor
        self._name = name

    def bind(self, *args: Any, **kwargs: Any) -> "ClassMethodNode":
        """A node of a graph: this method called with ``args`` (nodes or constants)."""
        from ._dag import ClassMethodNode

        return ClassMethodNode(self._actor, self._name, args, kwargs)

    def remote(self, *args: Any, **kwargs: Any) -> ObjectRef:
        """Call the method once, outside any graph (the slow path, for set-up). An actor in a
        live graph runs the call between two executions."""
        return self._actor._submit(self._name, args, kwargs)

    def options(self, **_options: Any) -> "ActorMethod":
        """Accepted for Ray compatibility (``num_returns`` is not supported)."""
        if _options.get("num_returns", 1) != 1:
            raise ValueError("num_returns other than 1 is not supported by adag's Python API")
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"actor methods cannot be called directly; use {self._name}.bind(...) in a graph "
            f"or {self._name}.remote(...) for a one-off call"
        )


class ActorHandle:
    """A live actor in its own worker process (Ray's ``ActorHandle``). Its methods are
    attributes: ``handle.forward.bind(x)``."""

    def __init__(self, native: Any, class_name: str) -> None:
        self._native = native
        self._class_name = class_name
        self._calls = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"adag-call-{native.name}"
        )

    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return ActorMethod(self, name)

    def __repr__(self) -> str:
        return (
            f"ActorHandle({self._class_name}, {self._native.name}, "
            f"node={self._native.host}, pid={self._native.pid})"
        )

    @property
    def _actor_name(self) -> str:
        return self._native.name

    @property
    def _node_id(self) -> str:
        """The ``NodeID`` of the host the actor runs on (``"0"``: the driver's)."""
        return str(self._native.host)

    @property
    def _pid(self) -> Optional[int]:
        return self._native.pid

    def _submit(self, method: str, args: tuple, kwargs: Dict[str, Any]) -> ObjectRef:
        from ._dag import _template

        def run() -> Any:
            resolved = [a.get() if isinstance(a, ObjectRef) else a for a in args]
            kw = {k: (v.get() if isinstance(v, ObjectRef) else v) for k, v in kwargs.items()}
            template, deps = _template(resolved, kw)
            if deps:
                raise TypeError(
                    f"{method}.remote(...) takes values (or ObjectRefs), not graph nodes; "
                    "use .bind(...) to build a graph"
                )
            return self._native.call(method, template)

        return ObjectRef(self._calls.submit(run))

    def _kill(self) -> None:
        self._native.kill()


class ActorClass(Generic[T]):
    """A class made remote by ``@adag.remote``: ``.remote(...)`` starts an actor."""

    def __init__(self, cls: type, options: Dict[str, Any]) -> None:
        self._cls = cls
        self._options = dict(options)
        self.__doc__ = cls.__doc__
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__module__ = cls.__module__

    def options(self, **options: Any) -> "ActorClass[T]":
        """The same class with other options.

        ``name=`` names the actor (errors and pictures show it). Where it runs:
        ``scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=..., soft=...)``
        (:mod:`adag.util.scheduling_strategies`; ``"SPREAD"``: the live hosts in turn,
        ``"DEFAULT"``: the driver's host) or adag's ``host=<NodeID or id>``; by default the
        driver's host. Ray's other options (``num_cpus``, ``num_gpus``, ``resources``, ...)
        are accepted and ignored; an unknown option is a ``TypeError``."""
        unknown = set(options) - _RAY_OPTIONS - {"name", "host"}
        if unknown:
            raise TypeError(f"unknown actor options: {', '.join(sorted(unknown))}")
        merged = dict(self._options)
        merged.update(options)
        return ActorClass(self._cls, merged)

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        """Start the actor: ``cls(*args, **kwargs)`` in a new worker process, on the host
        its options name. Raises :class:`~adag.exceptions.ActorDiedError` if the
        constructor fails (or the host is lost meanwhile), and
        :class:`~adag.exceptions.PlacementError` if the host it is placed on is not live."""
        from . import cluster
        from ._dag import _dumps_code

        _ensure_worker_command()
        name = self._options.get("name") or f"{self._cls.__name__}#{next(_numbers)}"
        host = cluster.placement(name, self._options)
        native = _native.spawn(
            _dumps_code(self._cls),
            tuple(args),
            dict(kwargs),
            [p for p in sys.path if isinstance(p, str)],
            name,
            host,
        )
        return ActorHandle(native, self._cls.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"actor class {self.__name__} cannot be instantiated directly; "
            f"use {self.__name__}.remote(...)"
        )


def remote(*args: Any, **options: Any) -> Any:
    """Make a class an actor class (Ray's ``@ray.remote``): ``@adag.remote`` or
    ``@adag.remote(num_gpus=1)``. Only classes: functions have no place in a compiled graph."""
    if len(args) == 1 and not options and isinstance(args[0], type):
        return ActorClass(args[0], {})
    if args:
        raise TypeError("@adag.remote takes a class, or keyword options only")

    def wrap(cls: type) -> ActorClass:
        if not isinstance(cls, type):
            raise TypeError("@adag.remote applies to classes (actors) only")
        return ActorClass(cls, {}).options(**options)

    return wrap


def method(*args: Any, **options: Any) -> Any:
    """Ray's ``@ray.method``: accepted for compatibility (``num_returns`` must be 1)."""
    if options.get("num_returns", 1) != 1:
        raise ValueError("num_returns other than 1 is not supported by adag's Python API")
    if len(args) == 1 and callable(args[0]):
        return args[0]
    return lambda f: f
