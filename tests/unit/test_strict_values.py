"""The core's strict checks of plain values (``specframe.values``): a bool is not a number, and the idiom is written
once, not at every site that reads a count or a ratio from a file, a flag or a plugin."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specframe.layouts import checks
from specframe.values import is_int, is_number

ROOT = Path(__file__).resolve().parents[2]

#: the idiom spelled out: "a bool, or not an int / number", or "an int / number and not a bool"
IDIOM = re.compile(r"isinstance\((\w[\w.]*), bool\) or not isinstance\(\1, int\b"
                   r"|isinstance\((\w[\w.]*), int[^)]*\) and not isinstance\(\2, bool\)")


@pytest.mark.parametrize("value", [True, False, "3", 3.0, None, [1]])
def test_only_an_int_is_an_int(value):
    assert not is_int(value)


def test_is_int_bounds_are_inclusive():
    assert is_int(0) and is_int(-5) and is_int(3, 1, 3) and is_int(1, 1)
    assert not is_int(0, 1) and not is_int(4, 1, 3) and not is_int(-1, 0)


def test_a_bool_is_not_a_number():
    assert is_number(1) and is_number(0.5) and is_number(float("nan"))
    assert not is_number(True) and not is_number("1") and not is_number(None)


def test_the_predicates_have_one_door():
    # layouts.checks builds on them but no longer re-exports them: every module imports them from specframe.values
    assert not hasattr(checks, "is_number")
    offenders = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "specframe").rglob("*.py"))
                 if re.search(r"from specframe\.layouts\.checks import [^\n]*\bis_(int|number)\b", p.read_text())]
    assert offenders == []


def test_the_core_spells_the_idiom_only_in_values():
    offenders = []
    for path in sorted((ROOT / "specframe").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "specframe/values.py":
            continue
        offenders += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if IDIOM.search(line)]
    assert offenders == []


@pytest.mark.parametrize("value", [-0.5, float("nan"), True, "1", None])
def test_a_non_negative_option_refuses_what_is_not_a_number_at_least_zero(value):
    """``api.non_negative`` (API 15), the validator P-EAGLE's and DSpark's options share (P-EAGLE's own let NaN in)."""
    from specframe import api, plugins

    with pytest.raises(api.UsageError, match="peagle option 'mask_hidden_std' must be a non-negative number"):
        plugins.get("drafter", "peagle").Options(mask_hidden_std=value)
    assert plugins.get("drafter", "peagle").Options(mask_hidden_std=0.0).mask_hidden_std == 0.0
