"""Artifacts on disk: one home for how the project publishes files and how it reads them back.

Writes are atomic: a file or folder is written beside its final path under a temporary name that
carries the writer's pid, then published with one rename, so a reader sees nothing or a complete
artifact. Published files get the user's umask (tempfile would make them private). A killed writer
cannot clean up after itself, so every writer first removes the temporary leftovers of writers that
are no longer alive.

Reads are checked: a missing, damaged (truncated) or mismatched artifact is an `ArtifactError`, a
one-line message that names the file and the command that remakes it; the verbs that make an
artifact treat a damaged one as missing and replace it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

_TEMPORARY = ".tmp-"
MISSING = "missing"
"""What `file_problem` says of a file that is not there."""


class ArtifactError(ValueError):
    """A missing, damaged or mismatched artifact; the message says which file and how to remake it."""


def _published_mode(directory: bool) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def _temporary_name(path: Path) -> Path:
    """`.NAME.tmp-PID.RANDOM` beside `path`: unique per write, and says which process wrote it."""
    return path.with_name(f".{path.name}{_TEMPORARY}{os.getpid()}.{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_leftovers(path: Path) -> None:
    """Delete the temporary copies of `path` left by writers that were killed (their pid is gone)."""
    for leftover in path.parent.glob(f".{path.name}{_TEMPORARY}*"):
        pid = leftover.name.rsplit(_TEMPORARY, 1)[1].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds it becomes `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    temporary = _temporary_name(path)
    try:
        yield temporary
        os.chmod(temporary, _published_mode(directory=False))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder beside `path`, published as `path` in one rename when the block
    succeeds. If another writer published `path` first, its copy is kept and this one is dropped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    staging = _temporary_name(path)
    staging.mkdir()
    try:
        yield staging
        staging.chmod(_published_mode(directory=True))
        try:
            staging.rename(path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file atomically."""
    with atomic_file(path) as temporary:
        temporary.write_text(text)


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write a safetensors file atomically, with string metadata."""
    with atomic_file(path) as temporary:
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, temporary, metadata=dict(metadata))


def file_problem(path: str | os.PathLike, expected: Mapping[str, object]) -> str | None:
    """Why the safetensors file at `path` is not the artifact `expected` (metadata) describes: MISSING,
    damaged (its header does not open: safetensors checks that the header covers the whole file), or
    made for something else; None when it is. The verbs that make artifacts remake a file with a problem."""
    path = Path(path)
    if not path.is_file():
        return MISSING
    try:
        with safe_open(path, framework="pt") as handle:
            stored = handle.metadata() or {}
    except SafetensorError as error:
        return f"damaged ({error})"
    differing = _differences(stored, expected)
    return f"made for something else ({'; '.join(differing)})" if differing else None


def read_tensors(
    path: str | os.PathLike, remake: str, names: tuple[str, ...] | None = None
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors (all, or `names`) of a safetensors artifact.

    remake: the command that makes the file again (in backquotes), named in the error when the file is
    missing or damaged."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; make it with {remake}")
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in (names or handle.keys())}
    except SafetensorError as error:
        raise ArtifactError(f"{path} is damaged ({error}); make it again with {remake}") from None
    return metadata, tensors


def check_metadata(
    path: str | os.PathLike, stored: Mapping[str, str], expected: Mapping[str, object], remake: str
) -> None:
    """One-line ArtifactError when the metadata stored with an artifact differs from what is expected."""
    differing = _differences(stored, expected)
    if differing:
        raise ArtifactError(f"{path} was made for something else ({'; '.join(differing)}); make it again with {remake}")


def _differences(stored: Mapping[str, str], expected: Mapping[str, object]) -> list[str]:
    return [
        f"{key}={stored.get(key)!r}, not {str(value)!r}"
        for key, value in expected.items()
        if stored.get(key) != str(value)
    ]
