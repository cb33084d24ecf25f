"""``DAGContext``: the process-wide defaults of compiled graphs (Ray's
``ray.dag.context.DAGContext``), read from ``RAY_CGRAPH_*`` variables at first use and
settable at run time. An ``experimental_compile`` option left at ``None`` takes its value
from here."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional

_lock = threading.Lock()
_current: Optional["DAGContext"] = None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


@dataclass
class DAGContext:
    """Defaults of every compiled graph of this process (Ray's ``DAGContext``).

    Fields (and the variables they are read from when the context is first made):

    - ``submit_timeout`` (``RAY_CGRAPH_submit_timeout``, 10 s): how long ``execute`` waits
      for room in the input channels.
    - ``get_timeout`` (``RAY_CGRAPH_get_timeout``, 10 s): the default timeout of
      ``adag.get`` on a compiled graph's ref. ``-1``: for ever.
    - ``teardown_timeout`` (``RAY_CGRAPH_teardown_timeout``, 30 s): accepted; adag's
      teardown ends each actor's loop itself and bounds every wait.
    - ``read_iteration_timeout`` (``RAY_CGRAPH_read_iteration_timeout_s``, 0.1 s):
      accepted; adag's readers wait on all inputs at once.
    - ``buffer_size_bytes`` (``RAY_CGRAPH_buffer_size_bytes``, 1,000,000): the initial
      size of a channel's slot (larger values still travel).
    - ``max_inflight_executions`` (``RAY_CGRAPH_max_inflight_executions``, 10).
    - ``max_buffered_results`` (``RAY_CGRAPH_max_buffered_results``, 1000).
    - ``overlap_gpu_communication`` (``RAY_CGRAPH_overlap_gpu_communication``, False).
    """

    submit_timeout: float = 10
    get_timeout: float = 10
    teardown_timeout: float = 30
    read_iteration_timeout: float = 0.1
    buffer_size_bytes: int = 1_000_000
    max_inflight_executions: int = 10
    max_buffered_results: int = 1000
    overlap_gpu_communication: bool = False

    def __post_init__(self) -> None:
        if self.read_iteration_timeout > self.get_timeout and self.get_timeout >= 0:
            raise ValueError(
                f"RAY_CGRAPH_read_iteration_timeout_s ({self.read_iteration_timeout}) must be "
                f"less than or equal to RAY_CGRAPH_get_timeout ({self.get_timeout})"
            )

    @staticmethod
    def get_current() -> "DAGContext":
        """The context of this process, made from the environment at the first call."""
        global _current
        with _lock:
            if _current is None:
                _current = DAGContext(
                    submit_timeout=_env_float("RAY_CGRAPH_submit_timeout", 10),
                    get_timeout=_env_float("RAY_CGRAPH_get_timeout", 10),
                    teardown_timeout=_env_float("RAY_CGRAPH_teardown_timeout", 30),
                    read_iteration_timeout=_env_float(
                        "RAY_CGRAPH_read_iteration_timeout_s", 0.1
                    ),
                    buffer_size_bytes=_env_int("RAY_CGRAPH_buffer_size_bytes", 1_000_000),
                    max_inflight_executions=_env_int(
                        "RAY_CGRAPH_max_inflight_executions", 10
                    ),
                    max_buffered_results=_env_int("RAY_CGRAPH_max_buffered_results", 1000),
                    # Any value but "" and "0" turns it on (Ray takes "0" for on too).
                    overlap_gpu_communication=os.environ.get(
                        "RAY_CGRAPH_overlap_gpu_communication", "0"
                    )
                    not in ("", "0"),
                )
            return _current
