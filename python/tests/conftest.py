"""Shared actor classes of the tests (importable by reference in the workers)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
