"""Ray's ``ray.dag.input_node``."""

from .._dag import InputAttributeNode, InputNode

__all__ = ["InputAttributeNode", "InputNode"]
