"""bench/inductor_forms.py without a GPU: every form's options are options of this torch's Inductor, and a form the
script does not know is refused before anything compiles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

pytest.importorskip("torch")

import inductor_forms  # noqa: E402


def test_every_form_names_options_inductor_has():
    import torch._inductor.config as cfg

    known = cfg.get_config_copy()
    assert inductor_forms.FORMS["default"] == {}
    for form, options in inductor_forms.FORMS.items():
        for key in options:
            assert key in known, (form, key)


def test_an_unknown_form_is_refused(capsys):
    with pytest.raises(SystemExit):
        inductor_forms.main(["--forms", "default,no such form"])
    assert "no such form" in capsys.readouterr().err
