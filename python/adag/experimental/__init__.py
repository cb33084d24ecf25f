"""Ray's ``ray.experimental`` names that Compiled Graphs programs use:
:mod:`adag.experimental.collective`, :mod:`adag.experimental.channel`,
:mod:`adag.experimental.compiled_dag_ref`, :mod:`adag.experimental.util.types`."""

from . import channel, collective, compiled_dag_ref, util

__all__ = ["channel", "collective", "compiled_dag_ref", "util"]
