"""Atomic writes and checked reads of artifacts (foresight.artifacts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foresight.artifacts import (
    MISSING,
    ArtifactError,
    _sort_header,
    atomic_file,
    atomic_folder,
    check_metadata,
    check_settings,
    file_problem,
    read_tensors,
    save_tensors,
    settings_differences,
    write_text,
)


def dead_pid() -> int:
    """The pid of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_atomic_folder_publishes_complete_folder_only(tmp_path: Path) -> None:
    final = tmp_path / "model"
    with atomic_folder(final) as staging:
        (staging / "weights").write_text("complete")
        assert not final.exists()
    assert (final / "weights").read_text() == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_folder_failed_write_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "model"
    with pytest.raises(RuntimeError), atomic_folder(final) as staging:
        (staging / "weights").write_text("partial")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_keeps_the_copy_published_first(tmp_path: Path) -> None:
    final = tmp_path / "model"
    with atomic_folder(final) as staging:
        (staging / "weights").write_text("second")
        with atomic_folder(final) as rival:  # another writer finishes first
            (rival / "weights").write_text("first")
    assert (final / "weights").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_published_artifacts_follow_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        write_text(tmp_path / "report.md", "text")
        save_tensors(tmp_path / "labels.safetensors", {"x": torch.zeros(2)}, {"format": "f"})
        with atomic_folder(tmp_path / "shard"):
            pass
    finally:
        os.umask(previous)
    assert (tmp_path / "report.md").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "labels.safetensors").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "shard").stat().st_mode & 0o777 == 0o750


def test_leftovers_of_killed_writers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    killed_folder = tmp_path / f".model.tmp-{dead_pid()}.0a0a0a0a"
    killed_folder.mkdir()
    (killed_folder / "weights").write_bytes(b"0" * 1024)
    killed_file = tmp_path / f".report.md.tmp-{dead_pid()}.0b0b0b0b"
    killed_file.write_text("partial")
    live = tmp_path / f".model.tmp-{os.getppid()}.0c0c0c0c"  # our parent is alive
    live.mkdir()
    with atomic_folder(tmp_path / "model"):
        pass
    write_text(tmp_path / "report.md", "complete")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", "report.md", live.name])


def test_a_failed_file_write_keeps_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    write_text(path, "old")
    with pytest.raises(RuntimeError), atomic_file(path) as temporary:
        temporary.write_text("new, half written")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_truncated_safetensors_is_unreadable_with_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "trace-000001.safetensors"
    save_tensors(path, {"alpha": torch.arange(1000.0)}, {"format": "labels/1"})
    assert file_problem(path, {"format": "labels/1"}) is None
    assert read_tensors(path, "`remake it`")[1]["alpha"].shape == (1000,)
    path.write_bytes(path.read_bytes()[:-100])
    assert file_problem(path, {}).startswith("damaged (")
    assert file_problem(tmp_path / "absent.safetensors", {}) == MISSING
    with pytest.raises(ArtifactError) as error:
        read_tensors(path, "`foresight labels --traces T -B 8 -L 2`")
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "damaged" in message
    assert message.endswith("`foresight labels --traces T -B 8 -L 2`")
    with pytest.raises(ArtifactError, match="missing; make it with `cmd`"):
        read_tensors(tmp_path / "absent.safetensors", "`cmd`")


def test_file_problem_names_what_the_file_was_made_for(tmp_path: Path) -> None:
    path = tmp_path / "trace-000001.safetensors"
    save_tensors(path, {"alpha": torch.zeros(3)}, {"budget": "128", "interval": "32"})
    assert file_problem(path, {"budget": 128}) is None
    assert file_problem(path, {"budget": 64, "interval": 32}) == "made with other settings (budget='128', not '64')"


def test_check_metadata_names_every_difference(tmp_path: Path) -> None:
    stored = {"budget": "128", "interval": "32", "dtype": "float16"}
    check_metadata(tmp_path, stored, {"budget": 128, "interval": 32}, "cmd")
    with pytest.raises(ArtifactError) as error:
        check_metadata(tmp_path, stored, {"budget": 64, "dtype": "float32", "interval": 32}, "cmd")
    assert "budget='128', not '64'" in str(error.value) and "dtype='float16', not 'float32'" in str(error.value)
    assert "interval" not in str(error.value)


def test_saved_tensors_are_the_same_bytes_in_every_process(tmp_path: Path) -> None:
    """safetensors orders metadata at random per process; save_tensors sorts the header, so two processes
    saving the same tensors and metadata write the same bytes, and the file reads back unchanged."""
    metadata = {f"key{i}": f"value {i}" for i in range(12)}
    script = (
        "import sys, torch\nfrom foresight.artifacts import save_tensors\n"
        "save_tensors(sys.argv[1], {'b': torch.arange(3.0), 'a': torch.ones(5, dtype=torch.int64)}, "
        f"{metadata!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    paths = [tmp_path / f"{name}.safetensors" for name in "xy"]
    for path in paths:
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    stored, tensors = read_tensors(paths[0], "`remake`")
    assert stored == metadata and torch.equal(tensors["b"], torch.arange(3.0))
    assert torch.equal(tensors["a"], torch.ones(5, dtype=torch.int64))


def test_a_header_of_another_length_is_rewritten_with_the_data_moved(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_tensors(path, {"x": torch.arange(6.0).reshape(2, 3)}, {"b": "2", "a": "1"})
    canonical = path.read_bytes()
    size = int.from_bytes(canonical[:8], "little")
    padded = (size + 16).to_bytes(8, "little") + canonical[8 : 8 + size] + b" " * 16 + canonical[8 + size :]
    path.write_bytes(padded)  # a header 16 bytes longer, as another writer might pad it
    _sort_header(path)
    assert path.read_bytes() == canonical


def test_a_mismatch_of_settings_is_one_line_in_one_format():
    """Labels, example caches, statistics, traces and evaluation runs refuse through `check_settings`: every
    differing setting as key=STORED, not WANTED, then the remedy; equal settings pass."""
    stored, wanted = {"a": 1, "b": "q", "c": 3}, {"a": 2, "b": "r", "c": 3}
    with pytest.raises(ArtifactError) as refused:
        check_settings("the thing", stored, wanted, "make it again")
    assert str(refused.value) == "the thing: made with other settings (a=1, not 2; b='q', not 'r'); make it again"
    assert settings_differences(stored, {"c": 3}) == [] and check_settings("x", stored, {"c": 3}, "") is None
