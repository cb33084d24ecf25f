"""Type stubs of the extension module ``adag._native`` (Rust, PyO3). Internal: use the
names of :mod:`adag`."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

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

class CompiledDAGRef:
    """The result of one output of one execution (Ray's ``CompiledDAGRef``)."""

    def get(self, timeout: Optional[float] = None) -> Any:
        """The value, waiting up to ``timeout`` seconds (``None``: the graph's default of
        10 s; negative: for ever); raises the task's error if the method failed."""
        ...
    def _wait(self, timeout: Optional[float] = None) -> Any: ...
    def _poll(self) -> Tuple[bool, Any]: ...

class NativeGraph:
    """A compiled graph of Python actors."""

    def __init__(
        self,
        parts: Sequence[Tuple[Any, ...]],
        nodes: Sequence[Tuple[NativeActor, str, bytes, List[int]]],
        outputs: Sequence[int],
        multi: bool,
        options: Dict[str, Any],
    ) -> None: ...
    @property
    def asyncio(self) -> bool: ...
    def execute(self, *args: Any, **kwargs: Any) -> Union[CompiledDAGRef, List[CompiledDAGRef]]: ...
    def try_submit_async(
        self, *args: Any, **kwargs: Any
    ) -> Optional[Union[CompiledDAGRef, List[CompiledDAGRef]]]: ...
    def submit_async(self, *args: Any, **kwargs: Any) -> Union[CompiledDAGRef, List[CompiledDAGRef]]: ...
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
