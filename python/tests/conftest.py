"""Shared set-up of the tests: actor classes importable by reference in the workers, and a
time limit on every test, so that a hang fails the run instead of blocking it."""
import faulthandler
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

#: Seconds a test may take before the run is stopped with every thread's traceback
#: (`@pytest.mark.timeout(s)` sets another limit for one test).
DEFAULT_TIMEOUT = float(os.environ.get("ADAG_TEST_TIMEOUT", "120"))


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): this test's time limit")


@pytest.fixture(autouse=True)
def _time_limit(request):
    """A test past its limit ends the run (exit status 1, tracebacks on stderr): the waits
    that hang are in native code with the GIL released, where no Python signal handler
    would run."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker else DEFAULT_TIMEOUT
    faulthandler.dump_traceback_later(limit, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
