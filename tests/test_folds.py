"""The fold study (`python -m studies folds`): families dealt into folds, every held-out trace scored once by
scorers fitted without its family, test families refused before any fit, and too many folds named in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from foresight.data.trace_store import TraceStore
from foresight.scorer.model import load_scorer
from studies.folds.run import Settings, deal_folds, run
from tests.fit_configs import tiny_config
from tests.prompts import DATA, sampled_tiny_traces

FAMILIES = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_dir) -> Path:
    """Twelve traces of the tiny model from three prompt files, four each: a corpus of three families."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = (DATA / "arithmetic.jsonl").read_text().splitlines()
    files = []
    for family in range(FAMILIES):
        path = folder / f"family{family}.jsonl"
        path.write_text("\n".join(lines[family::FAMILIES]) + "\n")
        files.append(f"{path}=1")
    out = folder / "traces"
    sampled_tiny_traces(",".join(files), out, num=4 * FAMILIES, model_name=str(tiny_dir))
    return out


def recorded(path: Path) -> list[dict]:
    """The trace scores of one record file, as dicts."""
    stored = json.loads(path.read_text())
    return [dict(zip(stored["columns"], row, strict=True)) for row in stored["rows"]]


def test_families_are_dealt_into_folds_of_near_equal_size():
    families = [f"f{i}" for i in range(7)]
    folds = deal_folds(families, 3, seed=0)
    assert sorted(folds) == families and sorted(list(folds.values()).count(k) for k in range(3)) == [2, 2, 3]
    assert deal_folds(families, 3, seed=0) == folds != deal_folds(families, 3, seed=1)
    with pytest.raises(ValueError, match=r"--folds 8 is more than the corpus's 7 families \(f0, f1"):
        deal_folds(families, 8, seed=0)


def test_every_held_out_trace_is_scored_by_scorers_that_never_saw_its_family(corpus, tmp_path, tiny_dir):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, holdout=0.0)
    settings = Settings(
        traces=corpus,
        folds=FAMILIES,
        config=config,
        variant=("base=", "wide=model.hidden=8"),
        regime=("decode",),
        per_family=3,
        test_sets=tmp_path / "no-test-sets",
        work=tmp_path / "work",
        out=tmp_path / "folds.md",
    )
    report = run(settings)
    scored = []
    for fold in range(FAMILIES):
        entries = recorded(tmp_path / "work" / "record" / f"decode-fold-{fold}.json")
        for name in ("base", "wide"):
            trained = set(
                load_scorer(tmp_path / "work" / "decode" / name / f"fold-{fold}" / "scorer").config.training_sources
            )
            held = {e["source"] for e in entries if e["policy"] == name}
            assert held and not held & trained and len(trained) == FAMILIES - 1
        scored += [e["index"] for e in entries if e["policy"] == "base" and e["token_set"] == "all"]
    assert sorted(scored) == sorted(set(scored))  # each trace once, in the fold of its family
    by_family = Counter(trace.source for trace in TraceStore(corpus) if trace.index in scored)
    assert len(by_family) == FAMILIES and set(by_family.values()) == {3}  # per_family: the first 3 of each
    assert "| base | 3 of 3 | " in report and "| wide | 3 of 3 | " in report
    assert "### decode regime, held-out families" in report
    assert not list((tmp_path / "work" / "decode").glob("examples*"))  # each cache removed after its fits
    assert run(settings) == report  # finished fits and evaluations are read again, not redone
    replays = sorted((tmp_path / "work" / "decode").glob("eval-fold-*-first3/replays/base/*/batch-*.pt"))
    kept = {path: path.stat().st_mtime_ns for path in replays}
    student = "late=model.hidden=4;model.teacher={fold_scorer:base}"  # one member distilled from the fold's base
    later_settings = dataclasses.replace(settings, variant=(*settings.variant, student))
    later = run(later_settings)
    assert "| late | 3 of 3 | " in later and report.split("| base | ")[1].split("\n")[0] in later
    card = (tmp_path / "work" / "decode" / "late" / "fold-1" / "scorer" / "README.md").read_text()
    assert f"the teacher {tmp_path / 'work' / 'decode' / 'base' / 'fold-1' / 'scorer'}" in card
    assert kept and {path: path.stat().st_mtime_ns for path in replays} == kept  # only the new variant replayed
    shipped = tmp_path / "work" / "decode" / "base" / "fold-0" / "scorer"  # a scorer as it is, on every fold
    with_shipped = run(dataclasses.replace(later_settings, scorer=(f"shipped={shipped}",)))
    assert "| shipped | 3 of 3 | " in with_shipped and not (tmp_path / "work" / "decode" / "shipped").exists()
    with pytest.raises(ValueError, match=r"--scorer base=\.\.\.: a variant has that name"):
        run(dataclasses.replace(settings, scorer=(f"base={shipped}",)))


def test_a_fold_study_resumes_on_a_fresh_machine_from_its_record_alone(corpus, tmp_path, tiny_dir):
    settings = Settings(
        traces=corpus,
        folds=FAMILIES,
        config=tiny_config(tmp_path / "tiny.yaml", tiny_dir, holdout=0.0),
        variant=("base=model.hidden=4",),
        regime=("decode",),
        per_family=2,
        test_sets=tmp_path / "no-test-sets",
        work=tmp_path / "work",
        record=tmp_path / "record",
        out=tmp_path / "folds.md",
    )
    run(dataclasses.replace(settings, fold=(0,)))  # one process's share: fold 0 alone
    assert [path.name for path in (tmp_path / "record").iterdir()] == ["decode-fold-0.json"]
    assert list((tmp_path / "work" / "decode").glob("examples*"))  # kept: the other folds' processes read it
    report = run(settings)
    assert not list((tmp_path / "work" / "decode").glob("examples*"))  # every fold done: removed
    files = {path.name: path.read_text() for path in sorted((tmp_path / "record").iterdir())}
    assert sorted(files) == [f"decode-fold-{fold}.json" for fold in range(FAMILIES)]
    rows = [json.loads(text) for text in files.values()]
    assert {row["variants"]["base"] for row in rows} == {"model.hidden=4"}
    token_sets = {entry[row["columns"].index("token_set")] for row in rows for entry in row["rows"]}
    assert token_sets == {"generated", "all"}
    shutil.rmtree(tmp_path / "work")  # the machine is gone; the record was committed
    assert run(settings) == report
    assert not (tmp_path / "work").exists()  # nothing fitted, labelled or replayed again
    student = dataclasses.replace(settings, variant=(*settings.variant, "late=model.teacher={fold_scorer:base}"))
    assert "| late | 3 of 3 | " in run(student)  # its teacher refitted, since the teacher's fit was gone
    assert (tmp_path / "work" / "decode" / "base" / "fold-0" / "scorer" / "config.json").is_file()
    for changed, message in (
        (dataclasses.replace(settings, variant=("base=model.hidden=8",)), "records variant 'base' as 'model.hidden=4'"),
        (dataclasses.replace(settings, per_family=3), r"made with other settings \(per_family=2, not 3\)"),
    ):
        before = {path.name: path.read_text() for path in (tmp_path / "record").iterdir()}
        with pytest.raises(Exception, match=message) as error:
            run(changed)
        assert "\n" not in str(error.value)
        assert {path.name: path.read_text() for path in (tmp_path / "record").iterdir()} == before


def test_a_variant_reading_a_later_or_unlike_scorer_or_a_fold_outside_is_refused_in_one_line(corpus, tmp_path):
    for options, message in (
        ({"variant": ("a=model.teacher={fold_scorer:b}", "b=")}, "reads variant 'b'"),
        ({"variant": ("b=data.feature_set=transfer", "a=model.teacher={fold_scorer:b}")}, "whose examples differ"),
        ({"folds": 3, "fold": (1, 3)}, r"--fold 3: the folds are 0\.\.2"),
        ({"train_per_family": 0}, "--train-per-family 0: take at least 1 trace of each family"),
    ):
        with pytest.raises(ValueError, match=message) as error:
            Settings(traces=corpus, **options)
        assert "\n" not in str(error.value)


def test_a_corpus_holding_a_test_family_is_refused_before_any_fit(corpus, tmp_path, tiny_dir):
    test_sets = tmp_path / "corpus"
    shutil.copytree(corpus, test_sets / "unseen-x")  # a test set of the same families
    settings = Settings(
        traces=corpus,
        folds=FAMILIES,
        config=tiny_config(tmp_path / "tiny.yaml", tiny_dir),
        test_sets=test_sets,
        work=tmp_path / "work",
    )
    with pytest.raises(ValueError, match=r"trace \d+ of .* is of .*family\d\.jsonl, a family of test set unseen-x"):
        run(settings)
    assert not (tmp_path / "work").exists()
