"""Artifacts on disk: one home for how the project publishes files and how it reads them back.

Writes are atomic: a file or folder is written beside its final path under a temporary name that
carries the writer's pid, then published with one rename, so a reader sees nothing or a complete
artifact. Published files get the user's umask (tempfile would make them private). A killed writer
cannot clean up after itself, so every writer first removes the temporary leftovers of writers that
are no longer alive.

Files are reproducible: a safetensors header is written with its keys sorted, so the same tensors and
metadata give the same bytes in any process (safetensors itself orders the metadata at random per process).

Work on a folder is shared by claims: several processes (or the ranks of a `torchrun` launch) walking the
same items each take an item by an exclusive `flock` on its claim file, which the kernel drops when the
process dies, so a killed process's claim is taken over (`claimed`).

Reads are checked: a missing, damaged (truncated) or mismatched artifact is an `ArtifactError`, a
one-line message that names the file and the command that remakes it; the verbs that make an
artifact treat a damaged one as missing and replace it.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

_TEMPORARY = ".tmp-"
_HEADER_ALIGNMENT = 8  # safetensors pads its JSON header with spaces to a multiple of 8 bytes
Item = TypeVar("Item")
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
        _sort_header(temporary)


def _sort_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with sorted keys, padded as safetensors pads it: in place
    when it keeps its length (reordered keys do), else with the data moved."""
    with open(path, "r+b") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % _HEADER_ALIGNMENT)
        if len(text) == size:
            handle.seek(8)
            handle.write(text)
            return
        data = handle.read()
        handle.seek(0)
        handle.write(len(text).to_bytes(8, "little") + text + data)
        handle.truncate()


def claimed(
    items: Iterable[Item], claim_file: Callable[[Item], Path], is_done: Callable[[Item], bool]
) -> Iterator[Item]:
    """The items this process claims and finds not done, each claim held until the caller asks for the next;
    run by several processes over the same items, each item is yielded to one of them.

    Free items come first; then the process waits for the claims others hold and takes over any item
    they left undone (a killed process's claim is dropped by the kernel), so each process returns only
    when every item is done. `is_done` is read with the claim held, so an item is done at most once; the
    caller must make it done before asking for the next. The claim file is removed once its item is done."""
    held_elsewhere = []
    for item in items:
        if not (yield from _take(item, claim_file(item), is_done, wait=False)):
            held_elsewhere.append(item)
    for item in held_elsewhere:
        yield from _take(item, claim_file(item), is_done, wait=True)


def _take(item: Item, path: Path, is_done: Callable[[Item], bool], wait: bool) -> Generator[Item, None, bool]:
    """Claim `item` and yield it unless done; False (nothing yielded) when another process holds its claim."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = os.open(path, os.O_RDWR | os.O_CREAT, _published_mode(directory=False))
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not is_done(item):
            yield item
        path.unlink(
            missing_ok=True
        )  # a process that opens it later makes a new file, claims it and finds the item done
        return True
    finally:
        os.close(handle)  # drops the claim


def file_problem(path: str | os.PathLike, expected: Mapping[str, object]) -> str | None:
    """Why the safetensors file at `path` is not the artifact `expected` (metadata) describes: MISSING,
    damaged (its header does not open: safetensors checks that the header covers the whole file), or
    made with other settings; None when it is. The verbs that make artifacts remake a file with a problem."""
    path = Path(path)
    if not path.is_file():
        return MISSING
    try:
        with safe_open(path, framework="pt") as handle:
            stored = handle.metadata() or {}
    except SafetensorError as error:
        return f"damaged ({error})"
    differing = settings_differences(stored, _as_metadata(expected))
    return f"made with other settings ({'; '.join(differing)})" if differing else None


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
    check_settings(str(path), stored, _as_metadata(expected), f"make it again with {remake}")


def settings_differences(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """Each setting `wanted` names whose stored value differs, as `key=STORED, not WANTED`: the one format of every
    refusal of an artifact made with other settings (labels, example caches, statistics, traces, evaluations)."""
    return [f"{key}={stored.get(key)!r}, not {value!r}" for key, value in wanted.items() if stored.get(key) != value]


def check_settings(what: str, stored: Mapping[str, Any], wanted: Mapping[str, Any], remedy: str) -> None:
    """One-line ArtifactError `WHAT: made with other settings (key=STORED, not WANTED; ...); REMEDY` when the
    settings an artifact was made with differ from the ones asked for."""
    differing = settings_differences(stored, wanted)
    if differing:
        raise ArtifactError(f"{what}: made with other settings ({'; '.join(differing)}); {remedy}")


def _as_metadata(expected: Mapping[str, object]) -> dict[str, str]:
    """Expected values as safetensors metadata holds them: strings."""
    return {key: str(value) for key, value in expected.items()}
