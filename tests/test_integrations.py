"""The integrations with other libraries import only beside them; without, the import says what to install
in one line (the kvpress press: tests/test_kvpress_learned.py checks it where kvpress is installed)."""

from __future__ import annotations

import importlib
import sys

import pytest

MODULE = "foresight.integrations.kvpress_press"


def test_the_kvpress_press_without_kvpress_is_a_one_line_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # as if kvpress were not installed
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(
        ImportError, match=rf"^{MODULE} needs kvpress \(.+\); install it in its own environment"
    ) as error:
        importlib.import_module(MODULE)
    assert "\n" not in str(error.value)
