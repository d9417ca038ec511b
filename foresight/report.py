"""Markdown reports with named sections, so each benchmark rewrites only its own part of a shared file."""

from __future__ import annotations

from pathlib import Path

from foresight.artifacts import write_text


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the section between `<!-- name:start -->` and `<!-- name:end -->` in `path`,
    leaving the rest of the file as it was; the file is replaced atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip() + ("\n\n" if text.strip() else "") + block
    write_text(path, text)
