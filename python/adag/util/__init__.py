"""Ray's ``ray.util`` names that adag provides: :mod:`adag.util.scheduling_strategies`."""

from . import scheduling_strategies

__all__ = ["scheduling_strategies"]
