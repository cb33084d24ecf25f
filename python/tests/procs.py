"""Process helpers of the tests: whether a process lives, waiting for processes to go."""

import time
from typing import Iterable


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: Iterable[int], seconds: float = 30.0) -> bool:
    """Wait up to `seconds` for every process of `pids` to be gone; whether they are."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False
