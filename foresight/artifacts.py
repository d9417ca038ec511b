"""The rules every safetensors artifact of a run follows: written under a temporary name and renamed
into place (a killed write leaves no torn file), and counted as done only when its header opens and its
metadata names what it was made for (a truncated or foreign file is remade, never trusted)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open

MISSING = "missing"


def replace_atomically(path: Path, write: Callable[[str], object]) -> None:
    """Call `write(temporary)` on a temporary file beside `path`, then rename it to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def file_problem(path: Path, expected: dict[str, str]) -> str | None:
    """Why the safetensors file at `path` is not the one `expected` describes: MISSING, damaged (its header
    does not open: safetensors checks that the header covers the whole file), or made for something else
    (a metadata value differs); None when it is."""
    if not path.is_file():
        return MISSING
    try:
        with safe_open(path, framework="pt") as handle:
            stored = handle.metadata() or {}
    except SafetensorError as error:
        return f"damaged ({error})"
    differing = [
        f"{name} {stored.get(name)!r}, expected {value!r}" for name, value in expected.items() if stored.get(name) != value
    ]
    return f"made for something else ({'; '.join(differing)})" if differing else None
