"""Graphs: nodes, compiling, executing and refs (internal; the names are exported by
:mod:`adag` and, at Ray's paths, by :mod:`adag.dag`).

Ray's rules hold: every node remembers the order it was bound in, and each actor runs its
tasks in that order (so a pipeline schedule bound as F0, F1, F2, B0, ... runs that way,
whatever order the outputs are listed in); the checks Ray makes at bind and compile time are
made here with Ray's exception classes and first words.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import os
import pickle
import uuid
import warnings
import weakref
from collections import deque
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _comm_plan, _native
from ._context import DAGContext
from .exceptions import CompileError, WrongModeError

#: Bind order: every node takes the next number when it is made. An actor runs its tasks in
#: this order (Ray's bind index), and arguments always come before their consumers.
_bind_order = itertools.count()

#: The method-name prefix of adag's own steps, run by the worker from ``adag._steps``.
STEP_PREFIX = "__adag_step__."


def _dumps_code(obj: Any) -> bytes:
    """Classes and constants for a worker: by value where pickle would go by reference to
    ``__main__`` (cloudpickle)."""
    try:
        import cloudpickle

        return cloudpickle.dumps(obj)
    except ImportError:  # pragma: no cover - cloudpickle is a dependency
        return pickle.dumps(obj, protocol=5)


def _template(
    args: Sequence[Any],
    kwargs: Dict[str, Any],
    num_returns: int = 1,
    out_device: Optional[str] = None,
) -> Tuple[bytes, List[Any]]:
    """The pickled call template of a bound method, and its node arguments in order.

    The template is ``(args, arg_slots, kwargs or None, kw_slots, num_returns, out_device,
    edges)``: positional constants with ``None`` where node argument ``i`` goes
    (``arg_slots``: ``(position, i)``), likewise for keywords, how many values the method
    returns (the worker checks the count when it is more than one), where the readers of the
    result place its tensors (``out_device``: ``"cpu"``, ``"cuda"``, or ``None`` for each
    tensor's own device; the node's ``with_tensor_transport(device=...)``), and per node
    argument ``(the node, as errors name it, its device or None)``: the worker places the
    tensors of a node argument where that node's annotation says. The worker caches it per
    node and fills in the values of each execution.
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
    edges = [(_node_text(d), _target_device(d)) for d in deps]
    return (
        _dumps_code((consts, arg_slots, kw_consts, kw_slots, num_returns, out_device, edges)),
        deps,
    )


def _target_device(node: Any) -> Optional[str]:
    """Where the readers of ``node`` place its tensors (``"cpu"``, ``"cuda"``), or ``None``
    for the sender's device: its type hint's ``device``."""
    hint = getattr(node, "_type_hint", None)
    return None if hint is None else hint._target()


class _NodeCounter(pickle.Pickler):
    """Counts the graph nodes inside an argument (in containers, or held by any object),
    the way pickling would find them, without writing anything."""

    def __init__(self) -> None:
        import io

        super().__init__(io.BytesIO(), protocol=5)
        self.found = 0

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, DAGNode):
            self.found += 1
            return self.found
        return None


def _nodes_inside(value: Any) -> int:
    """How many graph nodes an argument that is not itself a node holds."""
    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return 0
    counter = _NodeCounter()
    try:
        counter.dump(value)
    except Exception:
        # Not picklable by plain pickle (a lambda, a local class): look into the usual
        # containers by hand; cloudpickle will carry the rest.
        return _walk_count(value, 0)
    return counter.found


def _walk_count(value: Any, depth: int) -> int:
    if depth > 50:
        return 0
    if isinstance(value, DAGNode):
        return 1
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(_walk_count(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_walk_count(v, depth + 1) for v in value.values())
    return 0


class DAGNode:
    """A node of a graph. ``experimental_compile`` on the output node compiles the graph."""

    def __init__(self) -> None:
        self._bind_index = next(_bind_order)
        # Nodes that take this one as an argument (Ray's downstream nodes): compile walks
        # them to find every node of the graph, leaves included.
        self._consumers: List["DAGNode"] = []
        # The output node whose compile took this node (a node belongs to one graph).
        self._compiled_by: Optional["weakref.ref[DAGNode]"] = None
        # A TorchTensorType (with_tensor_transport / with_type_hint), or None.
        self._type_hint: Any = None

    def experimental_compile(
        self,
        _submit_timeout: Optional[float] = None,
        _buffer_size_bytes: Optional[int] = None,
        enable_asyncio: bool = False,
        _max_inflight_executions: Optional[int] = None,
        _max_buffered_results: Optional[int] = None,
        _overlap_gpu_communication: Optional[bool] = None,
        _default_communicator: Optional[Any] = "create",
    ) -> "CompiledDAG":
        """Compile the graph that ends in this node (Ray's ``experimental_compile``).

        Args:
            _submit_timeout: seconds ``execute`` may wait for room in the input channels.
            _buffer_size_bytes: the size of each shared-memory channel's slot; larger values
                still travel (as out-of-band buffers).
            enable_asyncio: the graph is driven by ``await execute_async(...)``.
            _max_inflight_executions: executions submitted but not yet read.
            _max_buffered_results: results read but not yet claimed by their ref.
            _overlap_gpu_communication: accepted; no effect on CPU values.
            _default_communicator: ``"create"`` (default), ``None`` or a communicator (a
                :class:`adag.experimental.channel.cpu_communicator.CPUCommunicator`).

        An option left at ``None`` takes its value from :class:`adag.dag.DAGContext`. Raises
        ``ValueError`` (:class:`~adag.exceptions.CompileError`) for a graph Ray would refuse,
        with Ray's message first.
        """
        if _buffer_size_bytes is not None and (
            not isinstance(_buffer_size_bytes, int)
            or isinstance(_buffer_size_bytes, bool)
            or _buffer_size_bytes <= 0
        ):
            raise CompileError(
                f"`buffer_size_bytes` must be a positive integer, found {_buffer_size_bytes}"
            )
        _check_communicator(_default_communicator)
        _warn_profiling()
        ctx = DAGContext.get_current()

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return CompiledDAG(
            self,
            default_communicator=_default_communicator,
            options={
                "submit_timeout": pick(_submit_timeout, ctx.submit_timeout),
                "get_timeout": ctx.get_timeout,
                "max_message_bytes": None,
                "buffer_size_bytes": pick(_buffer_size_bytes, ctx.buffer_size_bytes),
                "enable_asyncio": enable_asyncio,
                "max_inflight_executions": pick(
                    _max_inflight_executions, ctx.max_inflight_executions
                ),
                "max_buffered_results": pick(_max_buffered_results, ctx.max_buffered_results),
                "overlap_gpu_communication": pick(
                    _overlap_gpu_communication, ctx.overlap_gpu_communication
                ),
            },
        )

    def with_tensor_transport(
        self,
        transport: Any = "auto",
        device: Any = "default",
        _static_shape: bool = False,
        _direct_return: bool = False,
    ) -> "DAGNode":
        """Annotate this node's value as holding torch tensors (Ray's
        ``with_tensor_transport``); returns the node.

        ``device`` is where every reader places the tensors: ``"default"`` the sender's
        device type, ``"cpu"`` host memory, ``"gpu"``/``"cuda"`` the reader's current CUDA
        device (a ``RuntimeError`` "No CUDA GPUs are available", as Ray's, where it has
        none). ``transport``: ``"auto"``, ``"shm"``, ``"cpu"``,
        ``"accelerator"``/``"nccl"`` or a communicator; tensors always travel as their bytes
        through the graph's channels (shared memory on a host, TCP between hosts; a CUDA
        tensor through host memory). ``"accelerator"`` is checked at compile as Ray checks
        it (the writing actor has ``num_gpus``; not on the graph's input). Builds a
        :class:`~adag.experimental.channel.torch_tensor_type.TorchTensorType` (``ValueError``
        with Ray's messages for an invalid device or transport).
        """
        from .experimental.channel.communicator import Communicator
        from .experimental.channel.torch_tensor_type import TorchTensorType, _device

        device = _device(device)
        if isinstance(transport, Communicator):
            kind: Any = transport
        elif transport in ("auto", "shm"):
            kind = TorchTensorType.AUTO
        elif transport in ("nccl", "accelerator"):
            kind = TorchTensorType.ACCELERATOR
        elif transport == "cpu":
            kind = TorchTensorType.CPU
        else:
            raise ValueError(
                f"Invalid transport type: {transport!r}. Use 'auto' (default), 'shm', 'cpu', "
                "'accelerator' (or 'nccl'), or a Communicator instance"
            )
        return self.with_type_hint(
            TorchTensorType(
                transport=kind,
                device=device,
                _static_shape=_static_shape,
                _direct_return=_direct_return,
            )
        )

    def with_type_hint(self, typ: Any) -> "DAGNode":
        """Set this node's type hint (Ray's older API: ``with_type_hint(TorchTensorType(
        ...))``); returns the node. The node keeps a copy."""
        import copy

        from .experimental.channel.torch_tensor_type import TorchTensorType

        if not isinstance(typ, TorchTensorType):
            raise TypeError(
                f"with_type_hint takes a TorchTensorType (from "
                "adag.experimental.channel.torch_tensor_type), got "
                f"{type(typ).__name__}: values other than tensors need no hint"
            )
        self._type_hint = copy.deepcopy(typ)
        return self

    @property
    def type_hint(self) -> Any:
        """The node's :class:`TorchTensorType`, or ``None`` when it has none."""
        return self._type_hint

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        """Run the graph once without compiling it (Ray's classic ``dag.execute``): each
        task is a one-off call, in bind order; returns the output's
        :class:`~adag.ObjectRef` (a list of them for a :class:`MultiOutputNode`)."""
        return _interpret(self, args, kwargs)

    def _deps(self) -> List["DAGNode"]:
        return []

    def _add_consumer(self, node: "DAGNode") -> None:
        self._consumers.append(node)


#: Ray's profiling switches that adag does not implement (adag's timeline replaces them).
_PROFILING_VARIABLES = ("RAY_CGRAPH_ENABLE_TORCH_PROFILING", "RAY_CGRAPH_ENABLE_NVTX_PROFILING")


def _warn_profiling() -> None:
    import warnings

    for name in _PROFILING_VARIABLES:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            warnings.warn(
                f"{name} is set, but adag does not support it: no torch profiler or NVTX "
                "ranges are recorded. adag's timeline records every operation of every actor "
                "instead: set ADAG_TIMELINE=path.json before experimental_compile() (written "
                "as Chrome-trace JSON at teardown), or call compiled.timeline() / "
                "compiled.write_timeline(path) with it set (docs/observability.md)",
                UserWarning,
                stacklevel=3,
            )


def _check_type_hints(nodes: Sequence["DAGNode"]) -> None:
    """Ray's compile-time checks of the accelerator transport: the graph's input cannot use
    it (the driver takes part in no communicator), nor can an actor without a GPU unless a
    communicator of the program's own moves the tensors (it knows what it needs)."""
    for n in nodes:
        hint = n._type_hint
        if hint is None:
            continue
        comm = hint.get_custom_communicator()
        if isinstance(n, (InputNode, InputAttributeNode)):
            if hint.requires_accelerator() or comm is not None:
                raise CompileError(
                    "DAG inputs cannot be transferred via NCCL because the driver cannot "
                    f"participate in the NCCL group ({_node_text(n)} has transport "
                    f"{hint.transport!r}): annotate the input with_tensor_transport('auto'), "
                    "or the node that reads it"
                )
            continue
        if isinstance(n, ClassMethodNode) and hint.requires_accelerator() and comm is None:
            gpus = getattr(n._actor, "_num_gpus", 0) or 0
            if not gpus:
                name = getattr(n._actor, "_class_name", type(n._actor).__name__)
                raise CompileError(
                    f"Actor {name} returns a tensor with type hint "
                    'TorchTensor(transport="accelerator") or '
                    "TorchTensor(transport=accelerator_group_handle) but actor does not have "
                    f"an accelerator assigned by Ray ({_node_text(n)}): start the actor with "
                    ".options(num_gpus=1), or use with_tensor_transport('auto') (adag sends "
                    "tensors through host memory either way)"
                )


def _check_communicator(comm: Any) -> None:
    from .experimental.channel.communicator import Communicator

    if comm is None or isinstance(comm, Communicator):
        return
    if isinstance(comm, str):
        if comm != "create":
            raise CompileError(
                f"The only allowed string for default_communicator is 'create', got {comm}"
            )
        return
    raise CompileError(
        "The default_communicator must be None, a string, or a Communicator, got "
        f"{type(comm)}"
    )


class InputNode(DAGNode):
    """The input of a graph (Ray's ``InputNode``): use it in a ``with`` block; ``inp`` is
    the single argument of ``execute``, ``inp[i]`` its positional arguments, ``inp.key``
    and ``inp["key"]`` (the same node) its keyword arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Ray's own keywords, accepted.
        kwargs.pop("input_type", None)
        kwargs.pop("_other_args_to_resolve", None)
        if args or kwargs:
            raise ValueError("InputNode should not take any args or kwargs.")
        super().__init__()
        self._parts: Dict[Tuple[str, Any], InputAttributeNode] = {}

    def __enter__(self) -> "InputNode":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __getitem__(self, key: Union[int, str]) -> "InputAttributeNode":
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise AssertionError(
                "Please only use int index or str as first-level key to access fields of dag "
                f"input (got {key!r}: inp[i] is positional argument i of execute(), "
                "inp['k'] or inp.k its keyword argument k)."
            )
        return self._part("index" if isinstance(key, int) else "key", key)

    def __getattr__(self, key: str) -> "InputAttributeNode":
        if key.startswith("_"):
            raise AttributeError(key)
        return self._part("key", key)

    def _part(self, kind: str, what: Any) -> "InputAttributeNode":
        p = self._parts.get((kind, what))
        if p is None:
            p = self._parts[(kind, what)] = InputAttributeNode(self, kind, what)
        return p

    def __str__(self) -> str:
        return "InputNode()"


class InputAttributeNode(DAGNode):
    """A part of the input: ``inp[i]`` (positional argument ``i`` of ``execute``) or
    ``inp.key`` / ``inp["key"]`` (keyword argument ``key``)."""

    def __init__(self, input_node: InputNode, kind: str, what: Any) -> None:
        super().__init__()
        self._input = input_node
        self._kind = kind
        self._what = what

    @property
    def key(self) -> Union[int, str]:
        """The position or keyword this node reads (Ray's ``key``)."""
        return self._what

    def __str__(self) -> str:
        return f'InputAttributeNode["{self._what}"]'


class ClassMethodNode(DAGNode):
    """A method of an actor bound to arguments (``actor.method.bind(...)``).

    ``label`` is what errors and pictures call it when ``method`` is one of adag's own steps
    (the ``i``-th value of a method with ``num_returns``, a collective)."""

    def __init__(
        self,
        actor: Any,
        method: str,
        args: tuple,
        kwargs: Dict[str, Any],
        num_returns: int = 1,
        label: Optional[str] = None,
    ) -> None:
        super().__init__()
        self._actor = actor
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._num_returns = num_returns
        self._label = label or method
        for d in self._deps():
            d._add_consumer(self)

    def _deps(self) -> List[DAGNode]:
        return [a for a in list(self._args) + list(self._kwargs.values()) if isinstance(a, DAGNode)]

    def get_method_name(self) -> str:
        """The method's name (Ray's ``get_method_name``)."""
        return self._label

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise AttributeError(
            ".remote() cannot be used on ClassMethodNodes. Use .bind() instead to express an "
            "symbolic actor call."
        )

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        raise AttributeError(f".bind() cannot be used again on {type(self)}")

    def __str__(self) -> str:
        name = getattr(self._actor, "_class_name", type(self._actor).__name__)
        return f"ClassMethodNode({name}.{self._label}, bind_index={self._bind_index})"

    __repr__ = __str__


def _return_nodes(node: ClassMethodNode, n: int) -> Tuple[ClassMethodNode, ...]:
    """The ``n`` nodes of a method with ``num_returns=n``: each takes one value of the
    method's result, on the same actor (an in-actor hop, no copy between processes)."""
    return tuple(
        ClassMethodNode(
            node._actor,
            STEP_PREFIX + "return_value",
            (node,),
            {"index": i},
            label=f"{node._label}[{i}]",
        )
        for i in range(n)
    )


class FunctionNode(DAGNode):
    """A remote function bound to arguments (``f.bind(...)``): runs in a classic
    ``dag.execute``; a compiled graph refuses it, as Ray's does."""

    def __init__(self, function: Any, args: tuple, kwargs: Dict[str, Any]) -> None:
        super().__init__()
        self._function = function
        self._args = args
        self._kwargs = kwargs
        for d in self._deps():
            d._add_consumer(self)

    def _deps(self) -> List[DAGNode]:
        return [a for a in list(self._args) + list(self._kwargs.values()) if isinstance(a, DAGNode)]


class MultiOutputNode(DAGNode):
    """Several outputs (Ray's ``MultiOutputNode``): ``execute`` returns one ref each."""

    def __init__(self, args: Sequence[DAGNode], other_args_to_resolve: Any = None) -> None:
        if isinstance(args, tuple):
            args = list(args)
        if not isinstance(args, list):
            raise ValueError(
                f"Invalid input type for `args`, {type(args)}. MultiOutputNode takes a list "
                "of nodes: MultiOutputNode([a.f.bind(inp), b.g.bind(inp)])"
            )
        super().__init__()
        self._outputs = list(args)
        for d in self._outputs:
            if isinstance(d, DAGNode):
                d._add_consumer(self)

    def _deps(self) -> List[DAGNode]:
        return [o for o in self._outputs if isinstance(o, DAGNode)]


def _node_text(node: DAGNode) -> str:
    return str(node)


def _find_input(output: DAGNode) -> InputNode:
    """Ray's ``_find_root``: up through each node's first argument to the InputNode."""
    node = output
    seen = 0
    while not isinstance(node, InputNode):
        if isinstance(node, InputAttributeNode):
            return node._input
        deps = node._deps()
        if not deps:
            raise CompileError(
                "No InputNode found in the DAG: when traversing upwards, no upstream node was "
                f"found for {_node_text(node)}. Every task must read the graph's input, "
                "directly or through other tasks: bind it to the InputNode (or inp[i]) or "
                "to another node"
            )
        node = deps[0]
        seen += 1
        if seen > 1_000_000:  # pragma: no cover - a cycle cannot be built
            raise CompileError("the graph has a cycle")
    return node


def _check_containers(n: "ClassMethodNode") -> None:
    for arg in list(n._args) + list(n._kwargs.values()):
        if isinstance(arg, DAGNode):
            continue
        found = _nodes_inside(arg)
        if found:
            raise CompileError(
                f"Found {found} DAGNodes from the arg {arg} in {_node_text(n)}. Please ensure "
                "that the argument is a single DAGNode and that a DAGNode is not allowed to be "
                "placed inside any type of container."
            )


class _Walk:
    """Every node of the graph that ends in ``output``: Ray's traversal, up and down from the
    InputNode, so that nodes that reach no output are found and refused."""

    def __init__(self, output: DAGNode) -> None:
        self.output = output
        self.multi = isinstance(output, MultiOutputNode)
        self.outputs: List[DAGNode] = list(output._outputs) if self.multi else [output]  # type: ignore[attr-defined]
        for o in self.outputs:
            if not isinstance(o, DAGNode):
                raise CompileError(
                    f"MultiOutputNode takes graph nodes, and {o!r} is a "
                    f"{type(o).__name__}: list the nodes whose values execute() returns"
                )
        if not self.outputs:
            raise CompileError("MultiOutputNode([]) has no output: list the nodes to return")
        # Nodes inside containers first (Ray finds them while it walks the graph): such a
        # node is no argument of its task, so the walks below would not see it.
        seen_up = set()
        stack: List[DAGNode] = list(self.outputs)
        while stack:
            n = stack.pop()
            if id(n) in seen_up:
                continue
            seen_up.add(id(n))
            if isinstance(n, ClassMethodNode):
                _check_containers(n)
            stack.extend(n._deps())
        self.root = _find_input(self.outputs[0])
        self.nodes: List[DAGNode] = []
        seen = set()
        queue = deque([self.root, output])
        while queue:
            n = queue.popleft()
            if id(n) in seen:
                continue
            seen.add(id(n))
            self.nodes.append(n)
            if isinstance(n, MultiOutputNode) and n is not output:
                continue  # another graph's outputs (an abandoned MultiOutputNode)
            for d in n._deps():
                queue.append(d)
            for c in n._consumers:
                if isinstance(c, MultiOutputNode) and c is not output:
                    continue
                queue.append(c)
            if isinstance(n, InputNode):
                queue.extend(n._parts.values())
            if isinstance(n, InputAttributeNode):
                queue.append(n._input)
        self._check()

    def _check(self) -> None:
        output = self.output
        if output._compiled_by is not None and output._compiled_by() is output:
            raise CompileError(
                "It is not allowed to call `experimental_compile` on the same DAG object "
                "multiple times no matter whether `teardown` is called or not. Please reuse "
                "the existing compiled DAG or create a new one."
            )
        for n in self.nodes:
            other = n._compiled_by() if n._compiled_by is not None else None
            if other is not None and other is not output:
                raise CompileError(
                    "The DAG was compiled more than once. The following two nodes call "
                    f"`experimental_compile`: (1) {_node_text(other)}, (2) "
                    f"{_node_text(output)}. A node belongs to one compiled graph: build the "
                    "second graph from new nodes (a new InputNode and new bind() calls)"
                )
        for n in self.nodes:
            if isinstance(n, ClassMethodNode):
                _check_containers(n)
            if isinstance(n, FunctionNode):
                raise NotImplementedError(
                    "Compiled DAGs currently only support actor method nodes: "
                    f"{getattr(n._function, '__name__', n._function)}.bind(...) is a remote "
                    "function; make it a method of an actor, or run the graph without "
                    "compiling it (dag.execute)"
                )
        inputs = {id(n) for n in self.nodes if isinstance(n, InputNode)}
        if len(inputs) > 1:
            raise AssertionError(
                "More than one InputNode found: a graph reads one InputNode (use inp[i] and "
                "inp.key for several arguments)"
            )
        bound = [n for n in self.nodes if isinstance(n, (ClassMethodNode, MultiOutputNode))]
        reads_whole = any(self.root in n._deps() for n in bound)
        parts = [
            n
            for n in self.nodes
            if isinstance(n, InputAttributeNode) and any(n in c._deps() for c in bound)
        ]
        if reads_whole and parts:
            raise CompileError(
                "All tasks must either use InputNode() directly, or they must index to "
                "specific args or kwargs."
            )
        for n in self.nodes:
            if isinstance(n, ClassMethodNode) and not n._deps():
                raise CompileError(
                    "Compiled DAGs require each task to take a ray.dag.InputNode or at least "
                    f"one other DAGNode as an input. Invalid task node:\n{_node_text(n)}\n"
                    "Please bind the task to proper DAG nodes."
                )
        # Input parts that feed no output.
        contributing = set()
        stack: List[DAGNode] = list(self.outputs)
        while stack:
            n = stack.pop()
            if id(n) in contributing:
                continue
            contributing.add(id(n))
            stack.extend(n._deps())
        unused = [p for p in parts if id(p) not in contributing]
        if unused:
            keys = sorted({str(p.key) for p in parts})
            missing = sorted({str(p.key) for p in unused})
            verb = "is" if len(missing) == 1 else "are"
            raise CompileError(
                "Compiled Graph expects input to be accessed using all of attributes "
                f"{', '.join(keys)}, but {', '.join(missing)} {verb} unused. Ensure all input "
                "attributes are used and contribute to the computation of the Compiled Graph "
                "output."
            )
        outputs = {id(o) for o in self.outputs}
        leaves = [
            n
            for n in self.nodes
            if isinstance(n, ClassMethodNode)
            and id(n) not in outputs
            and not any(id(c) in {id(m) for m in self.nodes} for c in n._consumers)
        ]
        if leaves:
            raise CompileError(
                "Compiled DAG doesn't support leaf nodes, i.e., nodes that don't have "
                f"downstream nodes and are not output nodes. There are {len(leaves)} leaf "
                f"nodes in the DAG. Please add the outputs of "
                f"{[n.get_method_name() for n in leaves]} to the the MultiOutputNode."
            )
        for o in self.outputs:
            if not isinstance(o, ClassMethodNode):
                raise CompileError(
                    f"every output of a graph must be an actor method bound with .bind(...), "
                    f"and {_node_text(o)} is not: pass the input through an actor method"
                )


def _interpret(output: DAGNode, args: tuple, kwargs: Dict[str, Any]) -> Any:
    """Ray's classic (not compiled) execution: each task a one-off call, in bind order."""
    from ._actor import ObjectRef, RemoteFunction

    walk_nodes: List[DAGNode] = []
    seen = set()
    stack: List[DAGNode] = [output]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        walk_nodes.append(n)
        stack.extend(n._deps())
    values: Dict[int, Any] = {}

    def value_of(n: Any) -> Any:
        if not isinstance(n, DAGNode):
            return n
        if isinstance(n, InputNode):
            if len(args) != 1 or kwargs:
                raise ValueError(
                    f"dag.execute() must be called with 1 positional args, got {len(args)}"
                )
            return args[0]
        if isinstance(n, InputAttributeNode):
            return args[n._what] if n._kind == "index" else kwargs[n._what]
        return values[id(n)]

    for n in sorted(walk_nodes, key=lambda n: n._bind_index):
        if isinstance(n, ClassMethodNode):
            a = tuple(value_of(x) for x in n._args)
            kw = {k: value_of(v) for k, v in n._kwargs.items()}
            if n._method.startswith(STEP_PREFIX):
                from . import _steps

                step = getattr(_steps, n._method[len(STEP_PREFIX) :])
                src = a[0]
                values[id(n)] = ObjectRef.of_value(step(src.get(), **kw))
            else:
                ref = n._actor._submit(n._method, a, kw, n._num_returns, split=False)
                values[id(n)] = ref
        elif isinstance(n, FunctionNode):
            a = tuple(value_of(x) for x in n._args)
            kw = {k: value_of(v) for k, v in n._kwargs.items()}
            values[id(n)] = RemoteFunction.submit(n._function, a, kw)
    if isinstance(output, MultiOutputNode):
        return [value_of(o) for o in output._outputs]
    return value_of(output)


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
    it (Ray's ``CompiledDAGFuture``), once."""

    def __init__(self, native: Any, dag: "CompiledDAG") -> None:
        self._native = native
        self._dag = dag
        self._awaited = False

    def __await__(self):
        if self._awaited:
            raise ValueError(
                "CompiledDAGFuture can only be awaited upon once, and it has already been "
                "awaited upon."
            )
        # adag's future is polled on the loop's thread; while it is pending, the loop watches
        # the eventfd its waker signals (no thread, no GIL needed to wake).
        loop = asyncio.get_running_loop()
        while True:
            # Spin a little for the value only when nothing else in the loop is ready to run
            # (the spin would delay it); then sleep on the eventfd.
            idle = not getattr(loop, "_ready", True)
            done, value = self._native._poll(idle)
            if done:
                # Used up once it yields its value (an await cancelled on the way, by a
                # timeout, may be awaited again).
                self._awaited = True
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

    def __copy__(self) -> Any:
        raise ValueError("CompiledDAGFuture cannot be copied.")

    def __deepcopy__(self, memo: Any) -> Any:
        raise ValueError("CompiledDAGFuture cannot be deep copied.")

    def __reduce__(self) -> Any:
        raise ValueError("CompiledDAGFuture cannot be pickled.")

    def __str__(self) -> str:
        return f"CompiledDAGFuture({self._native})"


_live: "weakref.WeakSet[CompiledDAG]" = weakref.WeakSet()


class CompiledDAG:
    """A compiled graph (Ray's ``CompiledDAG``): ``execute`` many times, then
    ``teardown`` (also done when it is garbage-collected and at interpreter exit)."""

    def __init__(
        self, output: DAGNode, options: Dict[str, Any], default_communicator: Any = None
    ) -> None:
        outputs = list(output._outputs) if isinstance(output, MultiOutputNode) else [output]
        # Nodes a user's communicator serves become its steps (`adag._comm_plan`).
        self._comm_groups: Dict[str, Any] = _comm_plan.plan(
            _comm_plan.upstream(outputs), default_communicator
        )
        walk = _Walk(output)
        _check_type_hints(walk.nodes)
        self._multi = walk.multi
        outputs = walk.outputs
        order = sorted(
            (n for n in walk.nodes if isinstance(n, ClassMethodNode)),
            key=lambda n: n._bind_index,
        )
        index = {id(n): i for i, n in enumerate(order)}
        parts: List[DAGNode] = []
        part_index: Dict[int, int] = {}

        def arg_index(n: DAGNode) -> int:
            if isinstance(n, ClassMethodNode):
                return index[id(n)]
            if isinstance(n, (InputNode, InputAttributeNode)):
                if id(n) not in part_index:
                    parts.append(n)
                    part_index[id(n)] = len(parts) - 1
                return -part_index[id(n)] - 1
            raise CompileError(f"cannot use {type(n).__name__} as an argument")

        specs = []
        for n in order:
            template, deps = _template(
                n._args, n._kwargs, n._num_returns, _target_device(n)
            )
            specs.append(
                (n._actor._native, n._method, template, [arg_index(d) for d in deps], n._label)
            )
        part_specs = [
            ("whole",) if isinstance(p, InputNode) else (p._kind, p._what)  # type: ignore[attr-defined]
            for p in parts
        ]
        # What execute() must be called with (Ray's counts): one argument for the InputNode
        # itself, else as many as the highest inp[i] + 1, and every inp.key.
        if any(isinstance(p, InputNode) for p in parts):
            positional = 1
        else:
            positions = [p._what for p in parts if p._kind == "index"]  # type: ignore[attr-defined]
            positional = max(positions) + 1 if positions else 0
        keywords = sorted(p._what for p in parts if getattr(p, "_kind", None) == "key")  # type: ignore[attr-defined]
        self._asyncio = bool(options.get("enable_asyncio"))
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._id = uuid.uuid4().hex
        _comm_plan.initialize(self._comm_groups)
        try:
            self._native = _native.NativeGraph(
                part_specs,
                specs,
                [index[id(o)] for o in outputs],
                self._multi,
                options,
                positional,
                keywords,
                self._id,
            )
        except BaseException:
            _comm_plan.destroy(self._comm_groups)
            raise
        marker = weakref.ref(output)
        for n in walk.nodes:
            n._compiled_by = marker
        # The hot path straight to the native method (the method below documents it).
        self.execute = self._native.execute  # type: ignore[method-assign]
        # The actors stay alive as long as the graph.
        self._actors = [n._actor for n in order]
        # What visualize() names the nodes and input parts by.
        self._nodes: List[DAGNode] = order
        self._parts = parts
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
        :class:`MultiOutputNode`). Raises ``ValueError`` when the arguments do not match
        what the graph reads (Ray's message), and
        :class:`~adag.exceptions.RayCgraphCapacityExceeded` when
        ``_max_inflight_executions`` results are unread."""
        return self._native.execute(*args, **kwargs)

    async def execute_async(
        self, *args: Any, **kwargs: Any
    ) -> Union[CompiledDAGFuture, List[CompiledDAGFuture]]:
        """Submit one execution from asyncio code (a graph compiled with
        ``enable_asyncio=True``), waiting for room; returns futures to ``await``."""
        if not self._asyncio:
            raise WrongModeError(
                "Use execute_async if enable_asyncio=True: this graph was compiled without "
                "enable_asyncio; use execute(), or compile with "
                "experimental_compile(enable_asyncio=True)"
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

    def teardown(self, kill_actors: bool = False) -> None:
        """Stop the graph and release its actors (idempotent). Their processes live on for
        other graphs and one-off calls while their handles do; ``kill_actors=True`` kills
        them (Ray's option)."""
        self._native.teardown()
        groups, self._comm_groups = self._comm_groups, {}
        if groups:
            failed = _comm_plan.destroy(groups)
            if failed is not None:
                warnings.warn(f"tearing down {self}: {failed}", RuntimeWarning, stacklevel=2)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if kill_actors:
            for a in {id(a): a for a in self._actors}.values():
                try:
                    a._kill()
                except Exception:
                    pass

    def get_id(self) -> str:
        """The graph's unique id (hex), as ``str(ref)`` shows it (Ray's ``get_id``)."""
        return self._id

    def __str__(self) -> str:
        return f"CompiledDAG({self._id})"

    def visualize(
        self,
        filename: str = "compiled_graph",
        format: str = "png",
        view: bool = False,
        channel_details: bool = False,
    ) -> str:
        """Draw the graph: each task named by its actor and Python method
        (``Worker#1.forward#6``, then ``Worker.forward()`` and its type hint), the input parts
        as the program spells them (``inp[0]``), the outputs, and each actor's schedule (its
        steps in the order it runs them). ``channel_details=True`` labels each edge with how
        its reader gets the value (``shared memory``, ``in-memory``, ``network``, ``slot``: on
        the same actor) and each schedule with the actor's host and pid.

        As Ray does, Graphviz (the ``graphviz`` package and its ``dot`` program) writes the
        DOT source to ``filename`` and the picture to ``filename + "." + format``, opened
        when ``view=True``; returns the DOT source. Without Graphviz, ``ImportError`` (no
        package) or ``graphviz.ExecutableNotFound`` (no ``dot``) says what to install.
        ``format="ascii"`` writes nothing and returns a text picture, without Graphviz."""
        from . import _visualize

        if format == "ascii" and channel_details:
            raise ValueError("Parameters 'channel_details' are not compatible with 'ascii' format.")
        picture = _visualize.picture(self._native, self._nodes, self._parts)
        if format == "ascii":
            return picture.ascii()
        actors = {a._actor_name: a for a in self._actors}
        source = picture.dot(channel_details, actors)
        _visualize.render(source, filename, format, view)
        return source

    def stats(self) -> Dict[str, Any]:
        """Where the executions and time went so far (adag's ``CompiledGraph::stats``):
        executions submitted and in flight, results buffered, messages and bytes per edge,
        executions and busy seconds per actor. After teardown, the last counters."""
        return self._native.stats()

    def timeline(self) -> List[Dict[str, Any]]:
        """Every operation every actor recorded, when the graph was compiled with
        ``ADAG_TIMELINE`` set in the environment (one dict per operation: actor, pid, kind,
        name, execution, start and end in ns of the host's monotonic clock)."""
        return self._native.timeline()

    def write_timeline(self, path: str) -> None:
        """Write :meth:`timeline` as Chrome-trace JSON (open it in ui.perfetto.dev)."""
        self._native.write_timeline(path)

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
