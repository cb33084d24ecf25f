"""The codec of graph values: how a Python object becomes bytes on an edge and back.

This module is the package's one codec (internal). Its two entry points::

    stream, buffers = dumps(obj)        # pickle protocol 5; buffers: pickle.PickleBuffer list
    obj = loads(stream, buffers)        # buffers: objects with the buffer protocol

``dumps`` keeps every large buffer out of the stream (``buffer_callback``), so that the
native side (``python/src/value.rs``) sends each as an adag ``Buffer`` without a copy and the
reader gets it back in place (an ``adag._native.ShmBuffer`` over shared memory). numpy arrays
already travel so through plain pickle; this codec adds torch tensors:

- **A top-level CPU tensor** (``torch.Tensor`` or ``torch.nn.Parameter``, exactly) is not
  pickled at all: the native side asks :func:`tensor_parts` for its contiguous bytes and
  metadata and sends them as they are (``Kind::Tensor``); the reader makes it with
  :func:`tensor_from`, a tensor whose storage *is* the received memory.
- **Nested tensors** (in tuples, lists, dicts, dataclasses, any object pickle walks) are
  reduced by a private ``dispatch_table`` (a copy of ``copyreg.dispatch_table`` with entries
  for ``torch.Tensor`` and ``torch.nn.Parameter``; the global table is never changed) to
  ``(_rebuild_tensor, (PickleBuffer(bytes), dtype, shape, requires_grad, device,
  parameter))``, so their bytes go out of band like a numpy array's, instead of through
  torch's own ``__reduce_ex__`` (a ``torch.save`` of each storage into the stream).

Nothing here imports torch: a tensor can only be sent by a process that has torch loaded,
and torch is imported on the receiving side only when a value holds a tensor.

Devices: a CUDA tensor is copied to host memory by the writer ("host-staged") and moved back
to the reader's current CUDA device on receipt. A value carries the device type where its
tensors are to be placed: the sender's, or the one its edge asks for
(``with_tensor_transport(device=...)``, passed as ``device=`` to both functions: on
``dumps`` by the writing node, on ``loads`` by a reader whose edge says so).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import sys
import threading
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["dumps", "dumps_main", "loads", "tensor_from", "tensor_parts"]

#: The device the reducer and the rebuild function apply (per thread: an actor's thread and
#: the driver's threads each run their own dumps and loads).
_state = threading.local()

_torch_module: Any = None


def _torch() -> Any:
    """torch, imported only here and only once a value holds a tensor."""
    global _torch_module
    if _torch_module is None:
        import torch

        _torch_module = torch
    return _torch_module


#: dtype <-> its name without the ``torch.`` prefix (``"bfloat16"``), filled as met.
_dtype_names: Dict[Any, str] = {}
_dtypes: Dict[str, Any] = {}


def _dtype_name(dtype: Any) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).rpartition(".")[2]
    return name


#: Quantized dtypes: their bytes mean nothing without the quantizer, which torch pickles.
_QUANTIZED = frozenset(("qint8", "quint8", "qint32", "quint4x2", "quint2x4"))


def _dtype(name: str) -> Any:
    dtype = _dtypes.get(name)
    if dtype is None:
        if name in _QUANTIZED:
            raise TypeError(f"adag sends no quantized tensor as bytes (dtype {name})")
        dtype = getattr(_torch(), name, None)
        if not isinstance(dtype, _torch().dtype):
            raise TypeError(
                f"a torch.Tensor arrived with dtype {name!r}, which this process's torch "
                f"({_torch().__version__}) does not have: run the same torch version on "
                "both sides"
            )
        _dtypes[name] = dtype
    return dtype


def tensor_parts(t: Any, device: Optional[str] = None) -> Optional[Tuple[Any, ...]]:
    """What travels of tensor ``t``: ``(held, dtype, shape, requires_grad, device,
    parameter)``, where ``held`` is a contiguous CPU tensor whose bytes are sent (``t``
    itself, detached, when it already is one: no copy), ``device`` the device type the
    reader places it on (``device`` if given, else ``t``'s own), ``parameter`` whether it
    is a ``torch.nn.Parameter``. ``None`` for a tensor that has no plain bytes (sparse,
    quantized, nested, named, on a device other than CPU and CUDA): torch pickles those
    itself."""
    torch = _torch()
    if (
        t.layout is not torch.strided
        or t.is_quantized
        or t.is_nested
        or _dtype_name(t.dtype) in _QUANTIZED
        or t.has_names()
    ):
        return None
    source = t.device.type
    if source == "cpu":
        held = t.detach()
    elif source == "cuda":
        # Host-staged for now: the bytes travel through host memory.
        held = t.detach().cpu()
    else:
        return None
    # Conjugate and negative views keep their bit apart from the bytes: resolve them, or
    # the reader would see the unconjugated values.
    if held.is_conj():
        held = held.resolve_conj()
    if held.is_neg():
        held = held.resolve_neg()
    if not held.is_contiguous():
        held = held.contiguous()
    return (
        held,
        _dtype_name(held.dtype),
        tuple(held.shape),
        bool(t.requires_grad),
        device or source,
        type(t) is torch.nn.Parameter,
    )


#: Whether torch already warned that a buffer is not writable (it does so once per
#: process, from the first ``torch.frombuffer`` over read-only memory).
_frombuffer_warned = False


def _frombuffer(buf: Any, dtype: Any) -> Any:
    global _frombuffer_warned
    torch = _torch()
    if _frombuffer_warned:
        return torch.frombuffer(buf, dtype=dtype)
    # The memory is read-only and torch has no read-only tensors: it warns (once) that
    # writing through the tensor would write the buffer. adag's rule says so instead (a
    # received value shares the channel's memory: clone before writing in place).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        t = torch.frombuffer(buf, dtype=dtype)
    _frombuffer_warned = True
    return t


def tensor_from(
    buf: Any,
    dtype: str,
    shape: Sequence[int],
    requires_grad: bool = False,
    device: str = "cpu",
    parameter: bool = False,
) -> Any:
    """The tensor of received bytes ``buf`` (an object with the buffer protocol, or ``None``
    for no bytes): its storage is ``buf``'s memory itself (kept alive by the tensor), on
    ``device`` (``"cuda"``: copied to this process's current CUDA device)."""
    torch = _torch()
    dt = _dtype(dtype)
    if buf is None or memoryview(buf).nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        t = _frombuffer(buf, dt).view(shape)
    if device != "cpu":
        t = _place(t, device)
    if requires_grad:
        t.requires_grad_()
    if parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    return t


def _describe(t: Any) -> str:
    return f"a torch.Tensor (dtype={_dtype_name(t.dtype)}, shape={tuple(t.shape)})"


def _place(t: Any, device: str) -> Any:
    torch = _torch()
    if device == "cuda":
        if not torch.cuda.is_available():
            # Ray's class and first words (torch's own), so that code written for Ray's
            # error catches and matches this one.
            err = RuntimeError(_no_gpu_message(_describe(t)))
            err._adag_tensor = _describe(t)  # type: ignore[attr-defined]
            raise err
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    raise RuntimeError(
        f"{_describe(t)} arrived for device type {device!r}, which adag does not place "
        "tensors on (it knows 'cpu' and 'cuda'): send it from a CPU or CUDA tensor, or "
        'annotate the node that produces it with .with_tensor_transport(device="cpu")'
    )


def _no_gpu_message(what: str, where: Optional[str] = None) -> str:
    if where:
        what += f", {where},"
    return (
        f"No CUDA GPUs are available: {what} is to be placed on a CUDA device (it was a "
        "CUDA tensor where it was sent, or its edge asks for device='cuda'/'gpu'), but "
        f"this process (pid {os.getpid()}) has no GPU (torch.cuda.is_available() is "
        "False). To receive it in host memory, annotate the node that produces it with "
        '.with_tensor_transport(device="cpu"), or run this actor where a GPU is visible'
    )


def in_argument(exc: BaseException, method: str, index: int, source: str) -> BaseException:
    """A worker failed to decode node argument ``index`` of ``method`` (the value of node
    ``source``): the exception to report, saying which value when a tensor could not be
    placed on a GPU (others as they are)."""
    what = getattr(exc, "_adag_tensor", None)
    where = f"argument {index} of {method} (the value of {source})"
    if what is not None and isinstance(exc, RuntimeError):
        return RuntimeError(_no_gpu_message(what, where))
    # The method never ran: say so, which value and why, in one line (the unpickler's
    # frames tell the user nothing).
    text = (
        f"cannot decode {where} in this worker: {type(exc).__name__}: {exc} (the value was "
        "encoded where it was made and does not rebuild here: is its class importable in the "
        "worker, and the same version on both sides?)"
    )
    try:
        decoded = type(exc)(text)
    except Exception:
        decoded = RuntimeError(text)
    decoded.__suppress_context__ = True
    return decoded


def _rebuild_tensor(
    buf: Any,
    dtype: str,
    shape: Sequence[int],
    requires_grad: bool = False,
    device: str = "cpu",
    parameter: bool = False,
) -> Any:
    """Unpickling a nested tensor (see :func:`_reduce_tensor`): ``buf`` is the received
    buffer (read in place)."""
    return tensor_from(
        buf, dtype, shape, requires_grad, getattr(_state, "device", None) or device, parameter
    )


def _reduce_tensor(t: Any) -> Any:
    """The dispatch-table entry of ``torch.Tensor`` and ``torch.nn.Parameter``: the bytes
    out of band, as a ``PickleBuffer`` over the tensor's own memory (no copy)."""
    parts = tensor_parts(t, getattr(_state, "send_device", None))
    if parts is None:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    from . import _native

    held, dtype, shape, requires_grad, device, parameter = parts
    return (
        _rebuild_tensor,
        (
            pickle.PickleBuffer(_native.tensor_bytes(held)),
            dtype,
            shape,
            requires_grad,
            device,
            parameter,
        ),
    )


class _Pickler(pickle.Pickler):
    """``pickle.Pickler`` with this codec's private dispatch table (set by :func:`_table`)."""

    dispatch_table: Dict[Any, Any] = {}


#: The size of ``copyreg.dispatch_table`` when ``_Pickler.dispatch_table`` was copied from
#: it (a registration made later is picked up at the next ``dumps``).
_copied_len = -1
_table_lock = threading.Lock()


def _table() -> Dict[Any, Any]:
    global _copied_len
    if len(copyreg.dispatch_table) != _copied_len:
        torch = _torch()
        with _table_lock:
            table = dict(copyreg.dispatch_table)
            table[torch.Tensor] = _reduce_tensor
            table[torch.nn.Parameter] = _reduce_tensor
            _Pickler.dispatch_table = table
            _copied_len = len(copyreg.dispatch_table)
    return _Pickler.dispatch_table


def dumps(obj: Any, device: Optional[str] = None) -> Tuple[bytes, List[pickle.PickleBuffer]]:
    """Pickle ``obj`` (protocol 5) for an edge: the stream, and its out-of-band buffers in
    order (numpy arrays, ``PickleBuffer`` objects, torch tensors' bytes), none copied.

    ``device`` (``"cpu"``/``"cuda"``) is where the reader is to place the tensors inside
    (``with_tensor_transport(device=...)`` of the writing node); by default each tensor's
    own device type. Objects plain pickle refuses (lambdas, local classes) go by value
    through cloudpickle, tensors still out of band."""
    if device is None:
        return _dumps(obj)
    previous = getattr(_state, "send_device", None)
    _state.send_device = device
    try:
        return _dumps(obj)
    finally:
        _state.send_device = previous


def names_main(stream: bytes) -> bool:
    """Whether a pickle refers to something of ``__main__`` by name (a class, function or
    enum of the driver's script): the worker's ``__main__`` is not the script, so such a
    value goes by value instead (cloudpickle), as Ray does."""
    return b"__main__" in stream


def _dumps(obj: Any) -> Tuple[bytes, List[pickle.PickleBuffer]]:
    buffers: List[pickle.PickleBuffer] = []
    if "torch" in sys.modules:
        if len(copyreg.dispatch_table) != _copied_len:
            _table()
        f = io.BytesIO()
        try:
            _Pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
            stream = f.getvalue()
            if not names_main(stream):
                return stream, buffers
        except Exception:
            pass
    else:
        try:
            stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
            if not names_main(stream):
                return stream, buffers
        except Exception:
            pass
    del buffers[:]
    # It named something of `__main__`, or plain pickle refused it (in a worker, a class of
    # the driver's script rebuilt there): the script's objects by value, the rest as before.
    try:
        return dumps_main(obj, buffers), buffers
    except Exception as e:
        error = e
        del buffers[:]
    # What else plain pickle refuses (lambdas, local classes): all by value.
    try:
        return _cloud_dumps(obj, buffers), buffers
    except ImportError:
        raise error from None


#: The classes, functions and enums of the driver's script met so far, each with the key
#: and the definition (cloudpickled once) that stand for it in a stream; and by key, those
#: this process made or rebuilt.
_main_definitions: Dict[Any, Tuple[str, bytes]] = {}
_main_objects: Dict[str, Any] = {}
_main_lock = threading.Lock()


def _main_definition(obj: Any) -> Tuple[str, bytes]:
    with _main_lock:
        found = _main_definitions.get(obj)
        if found is None:
            import uuid

            import cloudpickle

            found = (uuid.uuid4().hex, cloudpickle.dumps(obj, protocol=5))
            _main_definitions[obj] = found
            _main_objects[found[0]] = obj
        return found


def _main_object(key: str, definition: bytes) -> Any:
    """Unpickling something of the driver's script: the object this process already has
    under ``key`` (its own, or one rebuilt before), else rebuilt from its definition once."""
    obj = _main_objects.get(key)
    if obj is None:
        with _main_lock:
            obj = _main_objects.get(key)
            if obj is None:
                obj = pickle.loads(definition)
                _main_objects[key] = obj
                _main_definitions[obj] = (key, definition)
    return obj


class _MainPickler(pickle.Pickler):
    """A pickler for values that name something of ``__main__``: each such class, function
    or enum travels as ``_main_object(key, definition)``, its definition pickled (by value,
    cloudpickle) once per process and rebuilt once per receiving process, not at every
    value; tensors out of band as in :func:`dumps`."""

    dispatch_table: Dict[Any, Any] = copyreg.dispatch_table

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            return (_main_object, _main_definition(obj))
        return NotImplemented


def dumps_main(obj: Any, buffers: List[pickle.PickleBuffer]) -> bytes:
    """Pickle ``obj`` with :class:`_MainPickler` (its buffers appended to ``buffers``)."""
    f = io.BytesIO()
    pickler = _MainPickler(f, protocol=5, buffer_callback=buffers.append)
    if "torch" in sys.modules:
        pickler.dispatch_table = _table()
    pickler.dump(obj)
    return f.getvalue()


_cloud_pickler: Any = None


def _cloud_dumps(obj: Any, buffers: List[pickle.PickleBuffer]) -> bytes:
    global _cloud_pickler
    import cloudpickle

    pickler = cloudpickle.CloudPickler
    if "torch" in sys.modules:
        if _cloud_pickler is None:
            from collections import ChainMap

            torch = _torch()

            class _CloudPickler(cloudpickle.CloudPickler):
                # cloudpickle's own table, with this codec's tensor entries in front.
                dispatch_table = ChainMap(
                    {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor},
                    cloudpickle.CloudPickler.dispatch_table,
                )

            _cloud_pickler = _CloudPickler
        pickler = _cloud_pickler
    f = io.BytesIO()
    pickler(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    return f.getvalue()


def loads(stream: Any, buffers: Sequence[Any] = (), device: Optional[str] = None) -> Any:
    """Unpickle what :func:`dumps` made: ``buffers`` are its buffers as received (read in
    place: a numpy array or tensor inside is a view of them). ``device`` (``"cpu"`` or
    ``"cuda"``) overrides where the tensors inside are placed (the reading edge's
    ``with_tensor_transport(device=...)``)."""
    if device is None:
        return pickle.loads(stream, buffers=buffers)
    previous = getattr(_state, "device", None)
    _state.device = device
    try:
        return pickle.loads(stream, buffers=buffers)
    finally:
        _state.device = previous
