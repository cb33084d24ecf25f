"""Actor classes of the tests, in a module of their own: workers import them by reference."""
import os
import sys
import time


class Echo:
    def __init__(self, offset=0):
        self.offset = offset
        self.calls = 0

    def echo(self, x):
        self.calls += 1
        return x

    def add(self, x, y=0):
        self.calls += 1
        return x + y + self.offset

    def count(self):
        return self.calls

    def plus_len(self, x, blob):
        return x + len(blob)

    def pid(self):
        return os.getpid()

    def sleep(self, seconds, x=None):
        time.sleep(seconds)
        return x

    def fail(self, x):
        raise ValueError(f"bad value {x}")

    def fail_unpicklable(self, x):
        class Local(Exception):
            def __reduce__(self):
                raise TypeError("cannot pickle this")

        raise Local(f"local {x}")

    def exit_now(self, x):
        os._exit(3)

    def info(self, arr):
        """What the actor sees of an array: its sum, whether it is writable, its base chain."""
        return float(arr.sum()), bool(arr.flags.writeable), type(arr.base).__name__

    def scale(self, arr, k=2):
        return arr * k

    def kind(self, x):
        return type(x).__name__, len(x)

    def loaded(self, module):
        """Whether this worker has imported `module`."""
        return module in sys.modules


class Broken:
    def __init__(self):
        raise RuntimeError("constructor says no")

    def echo(self, x):
        return x


def host_name():
    """The host an actor runs on, as its agent was named (``None`` on the driver's host)."""
    return os.environ.get("ADAG_HOST_NAME")


class Where(Echo):
    """An `Echo` that tells where it runs."""

    def where(self, x=None):
        return host_name(), os.getpid(), x

    def step(self, x):
        return x + self.offset


def _refuse_to_rebuild(why):
    raise ValueError(why)


class Unrebuildable:
    """A value that pickles, and whose unpickling fails (in any process)."""

    def __reduce__(self):
        return (_refuse_to_rebuild, ("this value does not rebuild",))
