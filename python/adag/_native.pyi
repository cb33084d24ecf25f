"""Type stubs of the extension module ``adag._native`` (Rust, PyO3). Internal: use the
names of :mod:`adag`."""

from typing import Any, Dict, List, Optional, Sequence, Tuple

class ShmBuffer:
    """Read-only bytes of a received value (often shared memory), with the buffer protocol;
    valid as long as this object or a view of it (a numpy array) lives."""

    def __len__(self) -> int: ...

class NativeActor:
    """A Python actor in its worker process."""

    @property
    def name(self) -> str: ...
    @property
    def pid(self) -> Optional[int]: ...
    def kill(self) -> None: ...
    def call(self, method: str, template: bytes) -> Any: ...

class NativeRef:
    """One output of one execution."""

    def get(self, timeout: Optional[float] = None) -> Any: ...
    def release(self) -> None: ...

class NativeGraph:
    """A compiled graph of Python actors."""

    def __init__(
        self,
        parts: Sequence[Tuple[Any, ...]],
        nodes: Sequence[Tuple[NativeActor, str, bytes, List[int]]],
        outputs: Sequence[int],
        options: Dict[str, Any],
    ) -> None: ...
    @property
    def asyncio(self) -> bool: ...
    def execute(self, *args: Any, **kwargs: Any) -> List[NativeRef]: ...
    def teardown(self) -> None: ...
    def visualize(self) -> str: ...

def spawn(
    class_bytes: bytes,
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    sys_path: List[str],
    name: Optional[str] = None,
) -> NativeActor: ...
def _worker_main() -> None: ...
def _set_worker_command(program: str, args: List[str]) -> None: ...
