"""Calls that actors make to other actors, through the driver.

An :class:`~adag.ActorHandle` passed to an actor (as a constructor or method argument)
arrives there as a handle whose ``.remote()`` calls are sent to this driver, which makes them
with its own handle and sends back the value. The service starts when the first handle is
pickled: a Unix socket in the abstract namespace (nothing on disk; gone with the process),
and every connection must prove it knows a fresh random key (``multiprocessing``'s HMAC
challenge) before it is served. Actors on other hosts cannot reach it (their calls raise an
error that says so).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
from multiprocessing.connection import Client, Listener
from typing import Any, Dict, Optional, Tuple

_lock = threading.Lock()
_service: Optional[Tuple[str, bytes]] = None
_listener: Optional[Listener] = None


def _dumps(value: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(value)


def address() -> Tuple[str, bytes, int]:
    """Where handles of this driver are served: ``(socket, key, driver pid)``; starts the
    service on first use."""
    global _service, _listener
    with _lock:
        if _service is None:
            key = secrets.token_bytes(32)
            path = "\0adag-calls-" + secrets.token_hex(12)
            _listener = Listener(path, family="AF_UNIX", authkey=key)
            threading.Thread(target=_accept, args=(_listener,), name="adag-calls", daemon=True).start()
            _service = (path, key)
        return (_service[0], _service[1], os.getpid())


def _accept(listener: Listener) -> None:
    while True:
        try:
            conn = listener.accept()
        except Exception:
            # A peer that failed the key challenge, or one that hung up while proving.
            continue
        threading.Thread(target=_serve, args=(conn,), name="adag-calls-conn", daemon=True).start()


def _serve(conn: Any) -> None:
    import pickle

    from ._actor import _handles

    with conn:
        while True:
            try:
                actor, method, args, kwargs, num_returns = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            try:
                ref = _handles.get(actor, lambda: None)()
                if ref is None:
                    raise RuntimeError(
                        f"Lost reference to actor {actor}: its last handle in the driver was "
                        "dropped, which ends the actor; keep a handle in the driver while other "
                        "actors call it"
                    )
                out = ref._submit(method, args, kwargs, 1).get()
                reply = (True, out)
            except BaseException as e:  # the caller raises it
                reply = (False, e)
            try:
                data = _dumps(reply)
            except Exception as e:
                data = _dumps((False, TypeError(f"the result of {actor}.{method} cannot be pickled: {e}")))
            conn.send_bytes(data)


class _Connection:
    """This process's connection to a driver's call service (one call at a time)."""

    def __init__(self, where: Tuple[str, bytes, int]) -> None:
        self._where = where
        self._conn: Any = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="adag-upcall")

    def call(self, actor: str, method: str, args: tuple, kwargs: Dict[str, Any], n: int) -> Any:
        import pickle

        with self._lock:
            if self._conn is None:
                try:
                    self._conn = Client(self._where[0], family="AF_UNIX", authkey=self._where[1])
                except (OSError, EOFError) as e:
                    raise RuntimeError(
                        f"cannot call {actor}.{method}: the driver (pid {self._where[2]}) that "
                        f"owns the actor cannot be reached from this process ({e}); a handle "
                        "passed to an actor works on the driver's host only"
                    ) from None
            self._conn.send_bytes(_dumps((actor, method, args, kwargs, n)))
            ok, value = pickle.loads(self._conn.recv_bytes())
        if not ok:
            raise value
        return value


_connections: Dict[Tuple[str, bytes, int], _Connection] = {}


def _connection(where: Tuple[str, bytes, int]) -> _Connection:
    with _lock:
        c = _connections.get(where)
        if c is None:
            c = _connections[where] = _Connection(where)
        return c


class RemoteActorHandle:
    """A handle of an actor of another process's driver (it came as an argument): its
    methods' ``.remote()`` calls go through that driver."""

    def __init__(self, name: str, class_name: str, methods: Dict[str, int], where: Tuple[str, bytes, int]) -> None:
        self._name = name
        self._class_name = class_name
        self._method_returns = methods
        self._where = where

    def __getattr__(self, name: str) -> "_RemoteMethod":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name not in self.__dict__.get("_method_returns", {}):
            raise AttributeError(f"'ActorHandle' object has no attribute '{name}'")
        return _RemoteMethod(self, name, self._method_returns[name])

    def __reduce__(self) -> Any:
        return (remote_handle, (self._name, self._class_name, self._method_returns, self._where))

    def __repr__(self) -> str:
        return f"ActorHandle({self._class_name}, {self._name}, via driver pid {self._where[2]})"


class _RemoteMethod:
    def __init__(self, handle: RemoteActorHandle, name: str, num_returns: int) -> None:
        self._handle = handle
        self._name = name
        self._num_returns = num_returns

    def options(self, **options: Any) -> "_RemoteMethod":
        return _RemoteMethod(self._handle, self._name, int(options.get("num_returns", self._num_returns)))

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        from ._actor import ObjectRef, _resolve, _split

        h = self._handle
        conn = _connection(h._where)

        def run() -> Any:
            a, kw = _resolve(args, kwargs)
            return conn.call(h._name, self._name, a, kw, 1)

        ref = ObjectRef(conn._pool.submit(run))
        return _split(ref, self._num_returns) if self._num_returns > 1 else ref

    def bind(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{self._handle._name}.{self._name}.bind(...): graphs are compiled by the driver "
            "that owns the actors; bind there"
        )


def remote_handle(name: str, class_name: str, methods: Dict[str, int], where: Tuple[str, bytes, int]) -> Any:
    """Rebuild a pickled handle: the driver's own handle in the driver, else one that calls
    through the driver."""
    if where[2] == os.getpid():
        from ._actor import _handles

        ref = _handles.get(name, lambda: None)()
        if ref is not None:
            return ref
    return RemoteActorHandle(name, class_name, methods, where)


__all__ = ["RemoteActorHandle", "address", "remote_handle"]
