"""bench/'s scripts import each other with bench/ on ``sys.path`` (as do the tests of them), ahead of site-packages:
a script named like an installed module hides it from every import in that process.  bench/kernels.py hid
Hugging Face's ``kernels`` package, which transformers imports when it is installed, and every transformers model
built after that failed to import (hence bench/kernel_profile.py)."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_script_is_named_like_an_installed_module():
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    hidden = {}
    for script in sorted(BENCH.glob("*.py")):
        name = script.stem
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        # (a folder without __init__.py is a namespace portion, origin None: a module of the name wins over it)
        if name in sys.builtin_module_names or (spec is not None and spec.origin is not None
                                                and Path(spec.origin).parent != BENCH):
            hidden[name] = spec.origin if spec is not None else "built in"
    assert not hidden, f"bench/ scripts named like installed modules (rename them): {hidden}"
