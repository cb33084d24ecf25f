"""Actors and tasks: ``@adag.remote`` classes and functions, handles, methods, one-off calls
and their refs (internal; the names are exported by :mod:`adag`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import os
import pickle
import sys
import threading
import time
import weakref
from typing import Any, Dict, Generic, List, Optional, Tuple, TypeVar

from . import _async_actor, _native
from .exceptions import ActorDiedError, GetTimeoutError, RaySystemError

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
    "max_pending_calls",
    "lifetime",
    "namespace",
    "runtime_env",
    "concurrency_groups",
    "get_if_exists",
    "placement_group",
    "placement_group_bundle_index",
    "placement_group_capture_child_tasks",
    "accelerator_type",
    "label_selector",
    "enable_task_events",
    "_metadata",
}

# `@ray.method(...)` / `actor.method.options(...)` keywords adag accepts; only `num_returns`
# changes anything.
_METHOD_OPTIONS = {
    "num_returns",
    "concurrency_group",
    "max_task_retries",
    "retry_exceptions",
    "enable_task_events",
    "tensor_transport",
    "name",
}

# `@ray.remote` options of a function (a one-off task in a worker process).
_TASK_OPTIONS = _RAY_OPTIONS | {"num_returns", "max_retries", "retry_exceptions", "name"}


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


def _functions(cls: type) -> Any:
    """``(class qualname, attribute, function)`` of the functions a class and its bases
    define (methods, static and class methods, properties)."""
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        for name, attr in vars(klass).items():
            for fn in (getattr(attr, "__func__", attr), getattr(attr, "fget", None)):
                if getattr(fn, "__code__", None) is not None:
                    yield klass.__qualname__, name, fn


def _dumps_class(cls: type) -> bytes:
    """An actor's class for its worker, with where its code came from: cloudpickle carries a
    class that travels by value (a class of ``__main__``, or one whose module name is bound
    to something else, such as the ``@adag.remote`` wrapper) with its code renamed
    ``<dynamic-code>``; the worker gives the code its file name back and registers the file's
    lines with ``linecache`` where it cannot read them, so tracebacks show the source."""
    import cloudpickle
    import linecache

    files: Dict[Tuple[str, str], str] = {}
    sources: Dict[str, List[str]] = {}
    for owner, name, fn in _functions(cls):
        filename = fn.__code__.co_filename
        files[(owner, name)] = filename
        if filename not in sources:
            lines = linecache.getlines(filename)
            if lines and sum(len(x) for x in lines) < (4 << 20):
                sources[filename] = lines
    return cloudpickle.dumps((cls, files, sources))


def _renamed(code: Any, filename: str) -> Any:
    """``code`` and the code nested in it (closures, comprehensions) with ``filename``."""
    consts = tuple(
        _renamed(c, filename) if hasattr(c, "co_filename") else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def _load_class(data: bytes) -> type:
    """In a worker: the class of :func:`_dumps_class`, its code named after its files and the
    files' lines known to ``linecache``."""
    import linecache

    cls, files, sources = pickle.loads(data)
    for owner, name, fn in _functions(cls):
        filename = files.get((owner, name))
        if filename and fn.__code__.co_filename != filename:
            try:
                fn.__code__ = _renamed(fn.__code__, filename)
            except (AttributeError, TypeError, ValueError):
                pass
    for name, lines in sources.items():
        # The driver's copy is what the class was made from (the file may change or go): a
        # cache entry without a time is never checked against the disk.
        linecache.cache[name] = (sum(len(x) for x in lines), None, lines, name)
    if _async_actor.is_async(cls):
        _async_actor.prepare(cls)
    return cls


def _num_returns(value: Any, where: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where}: num_returns={value!r} is not supported; adag takes a number of "
            "values of 1 or more (Ray's 'streaming' and 'dynamic' generators are not "
            "supported)"
        )
    return value


class ObjectRef(Generic[T]):
    """The result of a one-off call ``actor.method.remote(...)``, a task, or
    :func:`adag.put` (Ray's ``ObjectRef``): claim it with :func:`adag.get` (any number of
    times) or ``await`` it."""

    def __init__(self, future: "concurrent.futures.Future[T]") -> None:
        self._future = future

    @classmethod
    def of_value(cls, value: Any) -> "ObjectRef":
        """A ref whose value is ``value``, ready at once."""
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(value)
        return cls(f)

    def get(self, timeout: Optional[float] = None) -> T:
        """Wait for the value, up to ``timeout`` seconds (``None``: for ever)."""
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise GetTimeoutError(
                f"Get timed out: some object(s) not ready. Waited {timeout} s for a one-off "
                "call; raise the timeout= of adag.get(ref, timeout=...)"
            ) from None

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def future(self) -> "concurrent.futures.Future[T]":
        """The call as a ``concurrent.futures.Future``."""
        return self._future

    def hex(self) -> str:
        """An id of this ref (Ray's ``ObjectRef.hex``)."""
        return f"{id(self):016x}"

    def __repr__(self) -> str:
        return f"ObjectRef({self.hex()})"


class _PutValue:
    """The value of :func:`adag.put`: kept as a pickle, so the ref holds a snapshot and each
    ``get`` returns a copy (as Ray's object store does)."""

    def __init__(self, value: Any) -> None:
        self._bytes = _dumps(value)

    def load(self) -> Any:
        return pickle.loads(self._bytes)


def _dumps(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=5)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(value)


class _PutFuture(concurrent.futures.Future):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self._put = _PutValue(value)
        super().set_result(None)

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._put.load()


def put(value: Any) -> ObjectRef:
    """Ray's ``ray.put``: a ref to a snapshot of ``value`` (pass it to ``.remote()`` calls
    or :func:`adag.get` it). A compiled graph's ref cannot be put."""
    if _is_compiled_ref(value):
        raise TypeError(
            "CompiledDAGRef cannot be put: it was found to be non-serializable (get its value "
            "first)"
        )
    return ObjectRef(_PutFuture(value))


def _is_compiled_ref(value: Any) -> bool:
    from ._dag import CompiledDAGFuture, CompiledDAGRef

    return isinstance(value, (CompiledDAGRef, CompiledDAGFuture))


def _resolve(args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
    """Arguments of a one-off call: refs become their values (Ray's argument resolution)."""
    for v in itertools.chain(args, kwargs.values()):
        if _is_compiled_ref(v):
            raise TypeError("CompiledDAGRef cannot be used as Ray task/actor argument.")
    resolved = tuple(a.get() if isinstance(a, ObjectRef) else a for a in args)
    kw = {k: (v.get() if isinstance(v, ObjectRef) else v) for k, v in kwargs.items()}
    return resolved, kw


def _split(ref: ObjectRef, n: int) -> List[ObjectRef]:
    """The ``n`` refs of a call with ``num_returns=n`` (the worker checked the count)."""
    outs: List[concurrent.futures.Future] = [concurrent.futures.Future() for _ in range(n)]

    def done(f: concurrent.futures.Future) -> None:
        try:
            values = f.result()
            if len(values) != n:
                raise ValueError(
                    f"Expected {n} outputs, but got {len(values)} outputs: a call with "
                    f"num_returns={n} returns a tuple or list of {n} values"
                )
        except BaseException as e:  # every ref raises the call's error
            for o in outs:
                o.set_exception(e)
            return
        for o, v in zip(outs, values):
            o.set_result(v)

    ref._future.add_done_callback(done)
    return [ObjectRef(o) for o in outs]


def _signature(f: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(f)
    except (TypeError, ValueError):  # builtins and C types may have none
        return None


def _check_call(
    what: str, sig: Optional[inspect.Signature], args: tuple, kwargs: Dict[str, Any], verb: str
) -> None:
    """Ray's check of a call's arguments against the callee's signature (``TypeError``)."""
    if sig is None:
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"{e}. The {what} has a signature `{sig}`, but the given arguments to `{verb}` "
            f"doesn't match. args: {args}. kwargs: {kwargs}."
        ) from None


#: What a handle knows of its class's methods: name -> (signature without ``self`` or
#: ``None`` when it cannot be read, num_returns).
_MethodTable = Dict[str, Tuple[Optional[inspect.Signature], int]]


def _method_table(cls: type) -> _MethodTable:
    table: _MethodTable = {}
    for name in dir(cls):
        if name.startswith("__") and name.endswith("__"):
            continue
        try:
            attr = inspect.getattr_static(cls, name)
        except AttributeError:
            continue
        drop_self = True
        if isinstance(attr, staticmethod):
            fn, drop_self = attr.__func__, False
        elif isinstance(attr, classmethod):
            fn = attr.__func__
        elif inspect.isfunction(attr):
            fn = attr
        else:
            continue
        try:
            sig: Optional[inspect.Signature] = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and drop_self:
            params = list(sig.parameters.values())[1:]
            sig = sig.replace(parameters=params)
        n = _num_returns(
            getattr(fn, "__ray_num_returns__", 1), f"{cls.__name__}.{name}"
        )
        table[name] = (sig, n)
    return table


class ActorMethod:
    """A method of an actor: ``.bind(...)`` adds it to a graph, ``.remote(...)`` calls it
    once, ``.options(num_returns=n)`` makes it return ``n`` values (``n`` nodes, ``n``
    refs)."""

    def __init__(self, actor: "ActorHandle", name: str, num_returns: int = 1) -> None:
        self._actor = actor
        self._name = name
        self._num_returns = num_returns

    def _check(self, args: tuple, kwargs: Dict[str, Any], verb: str) -> None:
        sig = self._actor._methods.get(self._name, (None, 1))[0]
        _check_call(f"function `{self._name}`", sig, args, kwargs, verb)

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A node of a graph: this method called with ``args`` (nodes or constants); a tuple
        of ``num_returns`` nodes when the method returns several values. The arguments are
        checked against the method's signature (``TypeError``, Ray's message)."""
        from ._dag import ClassMethodNode, _return_nodes

        self._actor._check_session()
        if isinstance(self._actor._native, _Unborn):
            raise self._actor._native.died()
        self._check(args, kwargs, "bind")
        node = ClassMethodNode(self._actor, self._name, args, kwargs, self._num_returns)
        if self._num_returns > 1:
            return _return_nodes(node, self._num_returns)
        return node

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method once, outside any graph (the slow path, for set-up): an
        :class:`ObjectRef` (a list of ``num_returns`` refs). An actor in a live graph runs
        the call between two executions."""
        self._check(args, kwargs, "remote")
        return self._actor._submit(self._name, args, kwargs, self._num_returns)

    def options(self, **options: Any) -> "ActorMethod":
        """Ray's per-call options: ``num_returns`` (1 or more); ``concurrency_group``,
        ``max_task_retries``, ``retry_exceptions``, ``tensor_transport``,
        ``enable_task_events`` and ``name`` are accepted and change nothing."""
        unknown = set(options) - _METHOD_OPTIONS
        if unknown:
            raise TypeError(f"unknown method options: {', '.join(sorted(unknown))}")
        n = _num_returns(options.get("num_returns", self._num_returns), self._name)
        return ActorMethod(self._actor, self._name, n)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"Actor methods cannot be called directly. Instead of running "
            f"'object.{self._name}()', try 'object.{self._name}.remote()' for a one-off "
            f"call or 'object.{self._name}.bind()' in a graph."
        )


class ActorHandle:
    """A live actor in its own worker process (Ray's ``ActorHandle``). Its methods are
    attributes: ``handle.forward.bind(x)``. A handle may be passed to other actors (as a
    constructor or method argument): there its methods' ``.remote()`` calls run through
    this driver."""

    def __init__(
        self,
        native: Any,
        class_name: str,
        methods: _MethodTable,
        async_methods: frozenset = frozenset(),
        max_concurrency: int = 1,
    ) -> None:
        self._native = native
        self._class_name = class_name
        self._methods = methods
        # An async actor's one-off calls run concurrently (Ray's `max_concurrency`); a
        # sync actor's, one at a time in the order they were made.
        self._async_methods = async_methods
        self._calls = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrency if async_methods else 1,
            thread_name_prefix=f"adag-call-{native.name}",
        )
        self._session = _session
        _handles[native.name] = weakref.ref(self)

    def _check_session(self) -> None:
        """A handle of a session that ``adag.shutdown()`` ended is unusable, as in Ray."""
        if self._session != _session:
            raise RaySystemError(
                "Ray has not been started yet. You can start Ray with 'ray.init()'. "
                f"(adag: actor {self._native.name} was ended by adag.shutdown(); start a new "
                f"one with {self._class_name}.remote())"
            )

    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        entry = self.__dict__.get("_methods", {}).get(name)
        if entry is None:
            raise AttributeError(
                f"'ActorHandle' object has no attribute '{name}': class {self._class_name} "
                f"has no method {name} (its methods: {', '.join(sorted(self._methods)) or 'none'})"
            )
        return ActorMethod(self, name, entry[1])

    def __repr__(self) -> str:
        return (
            f"ActorHandle({self._class_name}, {self._native.name}, "
            f"node={self._native.host}, pid={self._native.pid})"
        )

    def __reduce__(self) -> Any:
        from . import _calls

        return (
            _calls.remote_handle,
            (
                self._native.name,
                self._class_name,
                {k: v[1] for k, v in self._methods.items()},
                _calls.address(),
            ),
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

    def _submit(
        self,
        method: str,
        args: tuple,
        kwargs: Dict[str, Any],
        num_returns: int = 1,
        split: bool = True,
    ) -> Any:
        from ._dag import _template

        def run() -> Any:
            resolved, kw = _resolve(args, kwargs)
            template, deps = _template(resolved, kw, num_returns)
            if deps:
                raise TypeError(
                    f"{method}.remote(...) takes values (or ObjectRefs), not graph nodes; "
                    "use .bind(...) to build a graph"
                )
            if method not in self._async_methods:
                return self._native.call(method, template)
            # On the actor's event loop, concurrently with its other calls (see
            # `adag._async_actor`): started, then asked about until done.
            start, _ = _template((method, tuple(resolved), kw), {})
            status, value = self._native.call("__adag_async_start__", start)
            while status == "pending":
                ask, _ = _template((value,), {})
                status, value = self._native.call("__adag_async_poll__", ask)
            return value

        self._check_session()
        for v in itertools.chain(args, kwargs.values()):
            if _is_compiled_ref(v):
                raise TypeError("CompiledDAGRef cannot be used as Ray task/actor argument.")
        ref = ObjectRef(self._calls.submit(run))
        return _split(ref, num_returns) if num_returns > 1 and split else ref

    def _kill(self) -> None:
        self._native.kill()
        release = self.__dict__.get("_release")
        if release is not None:  # the resources it held on a Ray cluster
            release()


class _Unborn:
    """The native side of an actor whose constructor raised (or whose host was lost while
    it started): every use raises Ray's ``ActorDiedError`` with the constructor's
    traceback."""

    pid = None

    def __init__(self, name: str, host: int, class_name: str, why: str) -> None:
        self.name = name
        self.host = host
        self._text = (
            "The actor died because of an error raised in its creation task, "
            f"{class_name}.__init__() ({name}): {why}"
        )

    def died(self) -> ActorDiedError:
        return ActorDiedError(self._text)

    def call(self, method: str, template: bytes) -> Any:
        raise self.died()

    def kill(self) -> None:
        return None


#: Live handles by actor name, for calls that other actors make through this driver, and for
#: ``adag.shutdown()`` to end.
_handles: "Dict[str, weakref.ref[ActorHandle]]" = {}

#: The session the handles made now belong to: ``adag.shutdown()`` ends it (Ray's
#: ``ray.shutdown``), and the next ``.remote()`` starts in a new one.
_session = 0


def _end_session() -> None:
    """Kill every actor this driver started (remote functions' workers too) and wait,
    bounded, until their worker processes are gone; their handles raise Ray's error from
    now on."""
    global _session, _tasks
    with _lock:
        _session += 1
        tasks, _tasks = _tasks, None
    handles = [h for h in (r() for r in list(_handles.values())) if h is not None]
    _handles.clear()
    pids = []
    for h in handles:
        pid = h._native.pid
        try:
            h._kill()
        except Exception:  # already dead, or a thread of a lost host: nothing left to end
            continue
        h._calls.shutdown(wait=False)
        if pid is not None and h._native.host == 0:
            pids.append(pid)
    if tasks is not None:
        tasks._pool.shutdown(wait=False)
    deadline = _now() + 10.0
    for pid in pids:
        while _now() < deadline and _process_exists(pid):
            time.sleep(0.005)


def _process_exists(pid: int) -> bool:
    """Whether process ``pid`` is still in the process table (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


class ActorClass(Generic[T]):
    """A class made remote by ``@adag.remote``: ``.remote(...)`` starts an actor."""

    def __init__(self, cls: type, options: Dict[str, Any]) -> None:
        self._cls = cls
        self._options = dict(options)
        self._methods: Optional[_MethodTable] = None
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
        constructor fails (with its traceback) or the host is lost meanwhile, and
        :class:`~adag.exceptions.PlacementError` if the host it is placed on is not live."""
        from . import cluster

        _ensure_worker_command()
        if self._methods is None:
            self._methods = _method_table(self._cls)
        _check_call(f"constructor of {self.__name__}", _signature(self._cls), args, kwargs, "remote")
        args, kwargs = _resolve(args, kwargs)
        name = self._options.get("name") or f"{self._cls.__name__}#{next(_numbers)}"
        host = cluster.placement(name, self._options)
        try:
            native = _native.spawn(
                _dumps_class(self._cls),
                tuple(args),
                dict(kwargs),
                [p for p in sys.path if isinstance(p, str)],
                name,
                host,
            )
        except ActorDiedError as e:
            # As in Ray: the handle is returned, and its first use raises (a program's
            # `try` around its first call catches it there).
            native = _Unborn(name, host, self.__name__, str(e))
        handle = ActorHandle(
            native,
            self._cls.__name__,
            self._methods,
            frozenset(
                name
                for name in self._methods
                if inspect.iscoroutinefunction(getattr(self._cls, name, None))
            ),
            int(self._options.get("max_concurrency") or 1000),
        )
        # What the compile checks of the accelerator transport read (Ray's: the actor has a GPU).
        handle._num_gpus = self._options.get("num_gpus") or 0
        from . import _ray

        if _ray.active():
            # On a Ray cluster the actor holds what it asked for (num_gpus=, ...) until its
            # handle is dropped or it is killed.
            _ray.claim(handle, host, _ray.request(self._options))
        return handle

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            "Compiled DAGs can only bind methods to an actor that is already created with "
            f"Actor.remote(): start the actor with {self.__name__}.remote(...) and bind its "
            "methods"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"Actors cannot be instantiated directly. Instead of '{self.__name__}()', use "
            f"'{self.__name__}.remote()'."
        )


class _TaskWorker:
    """The actor behind remote functions: runs one task at a time in its worker process."""

    def run(self, function: bytes, args: tuple, kwargs: Dict[str, Any]) -> Any:
        return pickle.loads(function)(*args, **kwargs)


class _TaskPool:
    """Worker processes for remote functions: one per thread of a pool as large as the
    machine's cores, started when first needed and kept for later tasks."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="adag-task"
        )
        self._workers: List[ActorHandle] = []

    def submit(self, function: bytes, name: str, args: tuple, kwargs: Dict[str, Any]) -> Any:
        from ._dag import _template

        def run() -> Any:
            worker = getattr(self._local, "worker", None)
            if worker is None:
                worker = ActorClass(_TaskWorker, {"name": f"task-worker#{next(_numbers)}"}).remote()
                self._local.worker = worker
                self._workers.append(worker)
            resolved, kw = _resolve(args, kwargs)
            template, _ = _template((function, resolved, kw), {})
            return worker._native.call("run", template)

        return self._pool.submit(run)


_tasks: Optional[_TaskPool] = None


class RemoteFunction:
    """A function made remote by ``@adag.remote`` (Ray's ``RemoteFunction``):
    ``.remote(*args)`` runs it once in a worker process and returns an :class:`ObjectRef`
    (a list of ``num_returns`` refs)."""

    def __init__(self, function: Any, options: Dict[str, Any]) -> None:
        self._function = function
        self._options = dict(options)
        self._pickled: Optional[bytes] = None
        self.__name__ = getattr(function, "__name__", "function")
        self.__doc__ = getattr(function, "__doc__", None)

    def options(self, **options: Any) -> "RemoteFunction":
        """The same function with other options: ``num_returns``; Ray's resource options
        are accepted and ignored."""
        unknown = set(options) - _TASK_OPTIONS
        if unknown:
            raise TypeError(f"unknown task options: {', '.join(sorted(unknown))}")
        merged = dict(self._options)
        merged.update(options)
        return RemoteFunction(self._function, merged)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Run the function once in a worker process."""
        _check_call(
            f"function `{self.__name__}`", _signature(self._function), args, kwargs, "remote"
        )
        n = _num_returns(self._options.get("num_returns", 1), self.__name__)
        if self._pickled is None:
            from ._dag import _dumps_code

            self._pickled = _dumps_code(self._function)
        ref = RemoteFunction.submit(self._pickled, args, kwargs, self.__name__)
        return _split(ref, n) if n > 1 else ref

    @staticmethod
    def submit(function: Any, args: tuple, kwargs: Dict[str, Any], name: str = "") -> ObjectRef:
        global _tasks
        for v in itertools.chain(args, kwargs.values()):
            if _is_compiled_ref(v):
                raise TypeError("CompiledDAGRef cannot be used as Ray task/actor argument.")
        if not isinstance(function, bytes):
            from ._dag import _dumps_code

            name = getattr(function, "__name__", "")
            function = _dumps_code(function)
        _ensure_worker_command()
        with _lock:
            if _tasks is None:
                _tasks = _TaskPool()
        return ObjectRef(_tasks.submit(function, name, args, kwargs))

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        """A node of a graph run by ``dag.execute()`` without compiling (a compiled graph
        takes actor methods only, as Ray's)."""
        from ._dag import FunctionNode

        return FunctionNode(self._function, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "Remote functions cannot be called directly. Instead of running "
            f"'{self.__name__}()', try '{self.__name__}.remote()'."
        )


def remote(*args: Any, **options: Any) -> Any:
    """Ray's ``@ray.remote``: on a class, an actor class (``.remote()`` starts an actor in a
    worker process of its own); on a function, a remote function (``.remote()`` runs it once
    in a worker process). ``@adag.remote`` or ``@adag.remote(num_gpus=1, ...)``."""

    def make(target: Any, opts: Dict[str, Any]) -> Any:
        if isinstance(target, type):
            return ActorClass(target, {}).options(**opts)
        if callable(target):
            return RemoteFunction(target, {}).options(**opts)
        raise TypeError(
            "The @adag.remote decorator must be applied to either a function or a class "
            f"(got {type(target).__name__})"
        )

    if len(args) == 1 and not options:
        return make(args[0], {})
    if args:
        raise TypeError("@adag.remote takes a class or a function, or keyword options only")
    return lambda target: make(target, options)


def method(*args: Any, **options: Any) -> Any:
    """Ray's ``@ray.method``: ``@adag.method(num_returns=2)`` on an actor's method makes it
    return two values (``a, b = actor.m.bind(x)``: two nodes); Ray's other options are
    accepted and change nothing."""
    if args and (len(args) != 1 or not callable(args[0]) or options):
        raise ValueError(
            "The @adag.method decorator must be applied using at least one keyword "
            "argument, e.g. @adag.method(num_returns=2)"
        )
    unknown = set(options) - _METHOD_OPTIONS
    if unknown:
        raise ValueError(f"unknown method options: {', '.join(sorted(unknown))}")
    n = _num_returns(options.get("num_returns", 1), "@adag.method")

    def mark(f: Any) -> Any:
        f.__ray_num_returns__ = n
        return f

    if args:
        return mark(args[0])
    return mark


def wait(
    object_refs: Any,
    *,
    num_returns: int = 1,
    timeout: Optional[float] = None,
    fetch_local: bool = True,
) -> Tuple[List[ObjectRef], List[ObjectRef]]:
    """Ray's ``ray.wait``: ``(ready, not_ready)`` once ``num_returns`` of ``object_refs``
    are ready or ``timeout`` seconds passed, each list in the order given. One-off calls,
    tasks and puts only: a compiled graph's refs are refused (as in Ray)."""
    if not isinstance(object_refs, list):
        raise TypeError(
            "wait() expected a list of ray.ObjectRef or ray.ObjectRefGenerator, got "
            f"{type(object_refs)}"
        )
    for r in object_refs:
        if not isinstance(r, ObjectRef):
            raise TypeError(
                "wait() expected a list of ray.ObjectRef or ray.ObjectRefGenerator, got list "
                f"containing {type(r)}"
            )
    if num_returns <= 0:
        raise ValueError("Invalid number of objects to return %d." % num_returns)
    if num_returns > len(object_refs):
        raise ValueError(
            "num_returns cannot be greater than the number of objects provided to ray.wait."
        )
    if len({id(r) for r in object_refs}) != len(object_refs):
        raise ValueError("Wait requires a list of unique object refs.")
    futures = {r._future: r for r in object_refs}
    pending = set(futures)
    done: set = set()
    deadline = None if timeout is None else (_now() + max(0.0, timeout))
    while len(done) < num_returns and pending:
        left = None if deadline is None else max(0.0, deadline - _now())
        got, pending = concurrent.futures.wait(
            pending, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
        )
        done |= got
        if left is not None and left <= 0:
            break
    ready: List[ObjectRef] = []
    for r in object_refs:
        if r._future in done and len(ready) < num_returns:
            ready.append(r)
    not_ready = [r for r in object_refs if all(r is not x for x in ready)]
    return ready, not_ready


def _now() -> float:
    return time.monotonic()
