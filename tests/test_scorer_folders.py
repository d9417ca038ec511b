"""A broken or foreign scorer folder is one line (rc 2, no traceback) in every verb that takes a scorer:
eval, rl, export, generate and replay (`--scorer`), bench paged-reclaim and rl-heldout. The check lives
in `foresight.scorer.model.load_scorer`; these tests hold each verb to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning  # noqa: F401  (its log handler binds stderr at import: before any test captures it)
import pytest
import yaml

from foresight import cli
from foresight.models import tiny_model
from foresight.scorer.model import load_scorer
from studies.__main__ import main as studies_main
from tests.scorers import random_scorer

B, L = 16, 4
REPO = Path(__file__).resolve().parents[1]


def _save_scorer(folder: Path, model, budget: int = B, interval: int = L, base_model: str = "tiny") -> Path:
    random_scorer(model, budget=budget, interval=interval, base_model=base_model).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_dir) -> Path:
    """A scorer of the tiny Llama at B = 16, L = 4."""
    return _save_scorer(tmp_path_factory.mktemp("good") / "scorer", tiny_model("llama"), base_model=str(tiny_dir))


def _broken(good: Path, out: Path, case: str) -> Path:
    """A copy of `good` damaged as `case` says."""
    folder = Path(shutil.copytree(good, out / case))
    weights, config = folder / "model.safetensors", folder / "config.json"
    if case == "truncated weights":  # a broken download: the header promises more bytes than there are
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif case == "missing weights":
        weights.unlink()
    elif case == "missing config":
        config.unlink()
    elif case == "config of another kind":  # TriAttention's statistics, a folder of the same two files
        shutil.copy(REPO / "checkpoints" / "triattention-default" / "config.json", config)
    elif case == "another model":
        shutil.rmtree(folder)
        _save_scorer(folder, tiny_model("llama", num_hidden_layers=3), base_model="other")
    elif case == "another cadence":
        shutil.rmtree(folder)
        _save_scorer(folder, tiny_model("llama"), budget=2 * B)
    return folder


MESSAGES = {
    "truncated weights": "model.safetensors is not a complete safetensors file",
    "missing weights": "is not a scorer folder (no model.safetensors)",
    "missing config": "is not a scorer folder (no config.json)",
    "config of another kind": "config.json is not a scorer's config (format 'foresight-triattention-stats/1')",
    "another model": "scorer trained for other (layers=3, query heads=4, KV heads=2, head dim=16) does not fit the model",
    "another cadence": "B=32, L=4",
}
"""What each case's line says (the folder's own problem, or that the scorer does not fit what is asked)."""

BROKEN = ("truncated weights", "missing weights", "missing config", "config of another kind")


@pytest.mark.parametrize("case", BROKEN)
def test_the_loader_says_what_is_wrong_with_a_folder(good, tmp_path, case):
    with pytest.raises(ValueError, match=f"^[^\n]*{MESSAGES[case].replace('(', '.').replace(')', '.')}[^\n]*$"):
        load_scorer(_broken(good, tmp_path, case))


def test_a_config_edited_away_from_its_weights_is_one_line(good, tmp_path):
    folder = Path(shutil.copytree(good, tmp_path / "edited"))
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"hidden": 16', '"hidden": 8'))
    with pytest.raises(
        ValueError,
        match="model.safetensors does not hold the weights of the scorer its config.json "
        r"describes \(.*size mismatch for w1",
    ):
        load_scorer(folder)


def _verb_args(verb: str, scorer: Path, good: Path, tiny_dir: Path, traces: Path, out: Path) -> list[str]:
    """The command line of `verb` reading `scorer`, otherwise valid, at B = 16, L = 4 on the tiny model."""
    cadence = ["-B", str(B), "-L", str(L)]
    if verb == "rl":
        config = out / "rl.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "seed_everything": 0,
                    "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "enable_progress_bar": False},
                    "model": {"group_size": 2},
                    "data": {
                        "model": str(tiny_dir),
                        "traces_dir": str(traces),
                        "budget": B,
                        "interval": L,
                        "batch_size": 1,
                    },
                }
            )
        )
        return ["rl", "--config", str(config), "--scorer", str(scorer), "--out", str(out / "rl")]
    text = out / "doc.txt"
    text.write_text("Some text to replay past a few evictions of the tiny cache.")
    learned = ["--model", str(tiny_dir), "--scorer", str(scorer), *cadence]
    return {
        "eval": [
            "eval",
            "--traces",
            str(traces),
            "--policies",
            "h2o",
            "--scorer",
            str(scorer),
            *cadence,
            "--out",
            str(out / "eval"),
        ],
        "export": ["export", "--scorer", str(scorer), "--out", str(out / "export")],
        "generate": ["generate", *learned, "--max-new-tokens", "30", "hi"],
        "replay": ["replay", *learned, str(text)],
        "bench paged-reclaim": [
            "bench",
            "paged-reclaim",
            "--traces",
            str(traces),
            "--policies",
            "h2o",
            "--scorer",
            str(scorer),
            "--budgets",
            str(B),
            "--interval",
            str(L),
            "--out",
            str(out / "paged.md"),
        ],
        "studies rl-heldout": [
            "rl-heldout",
            "--traces",
            str(traces),
            "--scorer",
            f"supervised={good}",
            "--scorer",
            f"reinforced={scorer}",
            "--resamples",
            "10",
            "--out",
            str(out / "rl.md"),
        ],
    }[verb]


VERBS = ("eval", "rl", "export", "generate", "replay", "bench paged-reclaim", "studies rl-heldout")
FITS = {  # the verbs that run a scorer on a model or a cadence they are asked for, and so must refuse another
    "another model": ("eval", "rl", "generate", "replay", "bench paged-reclaim", "studies rl-heldout"),
    "another cadence": ("rl", "generate", "replay"),
}


@pytest.mark.parametrize(
    ("verb", "case"),
    [(verb, case) for verb in VERBS for case in BROKEN]
    + [(verb, case) for case, verbs in FITS.items() for verb in verbs],
)
def test_every_verb_answers_a_bad_scorer_folder_in_one_line(verb, case, good, tiny_dir, traces_dir, tmp_path, capsys):
    scorer = _broken(good, tmp_path, case)
    study = verb.startswith("studies ")
    run, runner = (studies_main, "python -m studies") if study else (cli.main, f"foresight {verb.split()[0]}")
    assert run(_verb_args(verb, scorer, good, tiny_dir, traces_dir, tmp_path)) == 2
    printed = capsys.readouterr().err
    error = printed.strip().splitlines()[-1]  # after any progress bar or log line of the run before the error
    assert error.startswith(f"{runner}: error: ") and "Traceback" not in printed, printed
    assert MESSAGES[case] in error, error


def test_a_config_with_a_bad_value_names_its_file(good, tmp_path):
    folder = Path(shutil.copytree(good, tmp_path / "bad-cadence"))
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"interval": 4', '"interval": 16'))
    with pytest.raises(ValueError, match=r"bad-cadence/config.json: budget B=16 must be larger than the interval L=16"):
        load_scorer(folder)
