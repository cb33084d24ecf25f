"""Graphs: nodes, compiling, executing and refs (internal; the names are exported by
:mod:`adag`)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import pickle
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _native
from .exceptions import CompileError, WrongModeError


def _dumps_code(obj: Any) -> bytes:
    """Classes and constants for a worker: by value where pickle would go by reference to
    ``__main__`` (cloudpickle)."""
    try:
        import cloudpickle

        return cloudpickle.dumps(obj)
    except ImportError:  # pragma: no cover - cloudpickle is a dependency
        return pickle.dumps(obj, protocol=5)


def _template(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[bytes, List[Any]]:
    """The pickled call template of a bound method, and its node arguments in order.

    The template is ``(args, arg_slots, kwargs or None, kw_slots)``: positional constants with
    ``None`` where node argument ``i`` goes (``arg_slots``: ``(position, i)``), and likewise
    for keywords. The worker caches it per node and fills in the values of each execution.
    """
    deps: List[Any] = []
    index: Dict[int, int] = {}

    def slot(node: Any) -> int:
        key = id(node)
        if key not in index:
            index[key] = len(deps)
            deps.append(node)
        return index[key]

    consts: List[Any] = []
    arg_slots: List[Tuple[int, int]] = []
    for pos, a in enumerate(args):
        if isinstance(a, DAGNode):
            consts.append(None)
            arg_slots.append((pos, slot(a)))
        else:
            consts.append(a)
    kw_consts: Optional[Dict[str, Any]] = None
    kw_slots: List[Tuple[str, int]] = []
    if kwargs:
        kw_consts = {}
        for k, v in kwargs.items():
            if isinstance(v, DAGNode):
                kw_slots.append((k, slot(v)))
            else:
                kw_consts[k] = v
    return _dumps_code((consts, arg_slots, kw_consts, kw_slots)), deps


class DAGNode:
    """A node of a graph. ``experimental_compile`` on the output node compiles the graph."""

    def experimental_compile(
        self,
        _submit_timeout: Optional[float] = None,
        _buffer_size_bytes: Optional[int] = None,
        enable_asyncio: bool = False,
        _max_inflight_executions: Optional[int] = None,
        _max_buffered_results: Optional[int] = None,
        _overlap_gpu_communication: Optional[bool] = None,
        _default_communicator: Optional[Any] = None,
    ) -> "CompiledDAG":
        """Compile the graph that ends in this node (Ray's ``experimental_compile``).

        Args:
            _submit_timeout: seconds ``execute`` may wait for room in the input channels
                (default 10).
            _buffer_size_bytes: the size of each shared-memory channel's slot; larger values
                still travel (as out-of-band buffers).
            enable_asyncio: the graph is driven by ``await execute_async(...)``.
            _max_inflight_executions: executions submitted but not yet read (default 10).
            _max_buffered_results: results read but not yet claimed by their ref.
            _overlap_gpu_communication: accepted; no effect on CPU values.
            _default_communicator: accepted for collectives (``None`` or ``"create"``).
        """
        return CompiledDAG(
            self,
            {
                "submit_timeout": _submit_timeout,
                "max_message_bytes": None,
                "buffer_size_bytes": _buffer_size_bytes,
                "enable_asyncio": enable_asyncio,
                "max_inflight_executions": _max_inflight_executions,
                "max_buffered_results": _max_buffered_results,
                "overlap_gpu_communication": _overlap_gpu_communication,
            },
        )

    def with_tensor_transport(self, transport: Any = "auto", **_kwargs: Any) -> "DAGNode":
        """Ray's transport annotation. Accepted: every value of this package travels through
        shared memory, read in place (there is no GPU communicator for Python values)."""
        self._transport = transport
        return self

    def _deps(self) -> List["DAGNode"]:
        return []


class InputNode(DAGNode):
    """The input of a graph (Ray's ``InputNode``): use it in a ``with`` block; ``inp`` is
    the single argument of ``execute``, ``inp[0]`` and ``inp.key`` its positional and
    keyword arguments."""

    def __init__(self) -> None:
        self._parts: Dict[Tuple[str, Any], InputAttributeNode] = {}

    def __enter__(self) -> "InputNode":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __getitem__(self, index: int) -> "InputAttributeNode":
        if not isinstance(index, int):
            raise TypeError("inp[i] takes an integer position; use inp.key for keywords")
        return self._part("index", index)

    def __getattr__(self, key: str) -> "InputAttributeNode":
        if key.startswith("_"):
            raise AttributeError(key)
        return self._part("key", key)

    def _part(self, kind: str, what: Any) -> "InputAttributeNode":
        p = self._parts.get((kind, what))
        if p is None:
            p = self._parts[(kind, what)] = InputAttributeNode(self, kind, what)
        return p


class InputAttributeNode(DAGNode):
    """A part of the input: ``inp[i]`` or ``inp.key``."""

    def __init__(self, input_node: InputNode, kind: str, what: Any) -> None:
        self._input = input_node
        self._kind = kind
        self._what = what


class ClassMethodNode(DAGNode):
    """A method of an actor bound to arguments (``actor.method.bind(...)``)."""

    def __init__(self, actor: Any, method: str, args: tuple, kwargs: Dict[str, Any]) -> None:
        self._actor = actor
        self._method = method
        self._args = args
        self._kwargs = kwargs

    def _deps(self) -> List[DAGNode]:
        return [a for a in list(self._args) + list(self._kwargs.values()) if isinstance(a, DAGNode)]


class MultiOutputNode(DAGNode):
    """Several outputs (Ray's ``MultiOutputNode``): ``execute`` returns one ref each."""

    def __init__(self, outputs: Sequence[DAGNode]) -> None:
        self._outputs = list(outputs)

    def _deps(self) -> List[DAGNode]:
        return list(self._outputs)


#: The result of one output of one execution (Ray's ``CompiledDAGRef``), implemented by the
#: native module: ``ref.get(timeout=None)`` or :func:`adag.get`; a ref yields its value once.
CompiledDAGRef = _native.CompiledDAGRef


def _ready(fd: int, waiter: "asyncio.Future[None]") -> None:
    """The eventfd of an awaited ref became readable: drain it and resume the await."""
    try:
        os.read(fd, 8)
    except BlockingIOError:
        pass
    if not waiter.done():
        waiter.set_result(None)


class CompiledDAGFuture:
    """The result of one output of one execution of an ``enable_asyncio`` graph: ``await``
    it (Ray's ``CompiledDAGFuture``)."""

    def __init__(self, native: Any, dag: "CompiledDAG") -> None:
        self._native = native
        self._dag = dag

    def __await__(self):
        # adag's future is polled on the loop's thread; while it is pending, the loop watches
        # the eventfd its waker signals (no thread, no GIL needed to wake).
        loop = asyncio.get_running_loop()
        while True:
            done, value = self._native._poll()
            if done:
                return value
            waiter = loop.create_future()
            loop.add_reader(value, _ready, value, waiter)
            try:
                yield from waiter
            finally:
                loop.remove_reader(value)

    def get(self, timeout: Optional[float] = None) -> Any:
        """Wait for the value from synchronous code (a blocking call; ``timeout`` is not
        applied: use ``asyncio.wait_for`` on ``await``)."""
        return self._native._wait(timeout)


_live: "weakref.WeakSet[CompiledDAG]" = weakref.WeakSet()


class CompiledDAG:
    """A compiled graph (Ray's ``CompiledDAG``): ``execute`` many times, then
    ``teardown`` (also done when it is garbage-collected and at interpreter exit)."""

    def __init__(self, output: DAGNode, options: Dict[str, Any]) -> None:
        self._multi = isinstance(output, MultiOutputNode)
        outputs = output._outputs if self._multi else [output]
        order: List[DAGNode] = []
        seen: Dict[int, int] = {}
        parts: List[InputAttributeNode] = []
        part_index: Dict[int, int] = {}
        whole: List[Any] = []

        def visit(n: DAGNode) -> None:
            if id(n) in seen:
                return
            if isinstance(n, MultiOutputNode):
                raise CompileError("a MultiOutputNode can only be the output of a graph")
            seen[id(n)] = -1
            for d in n._deps():
                visit(d)
            if isinstance(n, ClassMethodNode):
                seen[id(n)] = len(order)
                order.append(n)

        for o in outputs:
            if not isinstance(o, ClassMethodNode):
                raise CompileError(
                    "every output of a graph must be an actor method bound with .bind(...)"
                )
            visit(o)

        def arg_index(n: DAGNode) -> int:
            if isinstance(n, ClassMethodNode):
                return seen[id(n)]
            if isinstance(n, InputNode):
                if not whole:
                    whole.append(("whole",))
                    parts.append(n)  # type: ignore[arg-type]
                    part_index[id(n)] = len(parts) - 1
                return -part_index[id(n)] - 1
            if isinstance(n, InputAttributeNode):
                if id(n) not in part_index:
                    parts.append(n)
                    part_index[id(n)] = len(parts) - 1
                return -part_index[id(n)] - 1
            raise CompileError(f"cannot use {type(n).__name__} as an argument")

        specs = []
        for n in order:
            template, deps = _template(n._args, n._kwargs)
            specs.append((n._actor._native, n._method, template, [arg_index(d) for d in deps]))
        part_specs = [
            ("whole",) if isinstance(p, InputNode) else (p._kind, p._what) for p in parts
        ]
        self._asyncio = bool(options.get("enable_asyncio"))
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._native = _native.NativeGraph(
            part_specs, specs, [seen[id(o)] for o in outputs], self._multi, options
        )
        # The hot path straight to the native method (the method below documents it).
        self.execute = self._native.execute  # type: ignore[method-assign]
        # The actors stay alive as long as the graph.
        self._actors = [n._actor for n in order]
        _live.add(self)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=16, thread_name_prefix="adag-async"
            )
        return self._pool

    def execute(self, *args: Any, **kwargs: Any) -> Union[CompiledDAGRef, List[CompiledDAGRef]]:
        """Submit one execution: ``inp`` is the single argument, ``inp[i]`` and ``inp.key``
        the positional and keyword arguments. Returns a ref (a list of refs for a
        :class:`MultiOutputNode`). Raises :class:`~adag.exceptions.CapacityExceededError`
        when ``_max_inflight_executions`` results are unread."""
        return self._native.execute(*args, **kwargs)

    async def execute_async(
        self, *args: Any, **kwargs: Any
    ) -> Union[CompiledDAGFuture, List[CompiledDAGFuture]]:
        """Submit one execution from asyncio code (a graph compiled with
        ``enable_asyncio=True``), waiting for room; returns futures to ``await``."""
        if not self._asyncio:
            raise WrongModeError(
                "this graph was compiled without enable_asyncio; use execute(), or compile "
                "with experimental_compile(enable_asyncio=True)"
            )
        native = self._native.try_submit_async(*args, **kwargs)
        if native is None:
            # Full: wait for room (up to _submit_timeout) on a thread of the graph.
            loop = asyncio.get_running_loop()
            native = await loop.run_in_executor(
                self._executor(), lambda: self._native.submit_async(*args, **kwargs)
            )
        if self._multi:
            return [CompiledDAGFuture(r, self) for r in native]
        return CompiledDAGFuture(native, self)

    def teardown(self) -> None:
        """Stop the graph and release its actors (idempotent). Their processes live on for
        other graphs and one-off calls while their handles do."""
        self._native.teardown()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def visualize(self) -> str:
        """The graph and each actor's schedule as Graphviz DOT text."""
        return self._native.visualize()

    def __del__(self) -> None:
        try:
            self._native.teardown()
        except Exception:
            pass


@atexit.register
def _teardown_all() -> None:
    for g in list(_live):
        try:
            g.teardown()
        except Exception:
            pass
