"""Every bench/ script with a ``main`` runs as the command its docstring gives: ``python3 bench/NAME.py --help``
prints its usage.  A script whose ``if __name__ == "__main__":`` block went missing imports, defines ``main`` and
exits 0 having done nothing, so a device call that ran it came back empty (bench/inductor_forms.py lost its block
in a review's edit and its first device run printed nothing)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _scripts() -> list[Path]:
    found = []
    for script in sorted(BENCH.glob("*.py")):
        tree = ast.parse(script.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            found.append(script)
    return found


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.name)
def test_a_bench_script_runs_as_a_command(script):
    p = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                       cwd=BENCH.parent)
    assert p.returncode == 0 and p.stdout.lstrip().startswith("usage:"), (p.returncode, p.stdout[-500:],
                                                                           p.stderr[-1500:])
