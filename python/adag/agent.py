"""A host's agent for Python actors::

    ADAG_JOIN=<driver ip:port> ADAG_TOKEN=<secret> python -m adag.agent

joins the driver (which listens: ``adag.init(listen=..., token=...)``) and starts the
worker processes of the actors placed on this host, each this interpreter running the
actor's class. Run it with the driver's Python environment (the same ``adag`` build, the
actors' modules importable). It stays until the driver leaves, then exits with status 0;
with status 3 when it cannot join (no driver at the address, another secret). Optional:
``ADAG_HOST_NAME`` (the name :func:`adag.nodes` lists), ``ADAG_DATA_ADDR`` and
``ADAG_DATA_ADVERTISE`` (where this host's data port listens and what other hosts dial), as
in ``docs/multi-host.md``.
"""

from __future__ import annotations

import os
import signal
import sys

from . import _native
from ._actor import _ensure_worker_command
from .cluster import ENV_JOIN, ENV_TOKEN


def main() -> int:
    """Run this process as a host's agent; its exit status."""
    if not os.environ.get(ENV_JOIN):
        sys.stderr.write(
            f"usage: {ENV_JOIN}=<driver ip:port> {ENV_TOKEN}=<secret> python -m adag.agent\n"
        )
        return 2
    # The agent waits in Rust with the GIL released: let a signal end it at once (its
    # workers die with it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _ensure_worker_command()
    code = _native._run_agent()
    return 2 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
