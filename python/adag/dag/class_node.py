"""Ray's ``ray.dag.class_node``."""

from .._dag import ClassMethodNode

__all__ = ["ClassMethodNode"]
