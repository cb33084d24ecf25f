"""Ray's ``ray.dag.output_node``."""

from .._dag import MultiOutputNode

__all__ = ["MultiOutputNode"]
