"""The Ray-style programs of ``examples/python`` run, and differ from Ray programs in their
import lines only."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python")
PROGRAMS = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))


def test_there_are_examples():
    assert {"quickstart.py", "pipeline_parallel.py", "asyncio_server.py"} <= set(PROGRAMS)


@pytest.mark.parametrize("program", PROGRAMS)
def test_only_import_lines_name_adag(program):
    with open(os.path.join(EXAMPLES, program)) as f:
        code = f.read()
    body = code.split('"""', 2)[2] if code.startswith('"""') else code
    for line in body.splitlines():
        if "adag" in line.split("#")[0]:
            assert re.match(r"^(import adag as ray|from adag[.\w]* import )", line), line


@pytest.mark.parametrize("program", PROGRAMS)
def test_example_runs(program):
    out = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, program)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{program[:-3]}: ok" in out.stdout, out.stdout
