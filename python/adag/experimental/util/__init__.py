"""Ray's ``ray.experimental.util``: :mod:`adag.experimental.util.types`."""

from . import types

__all__ = ["types"]
