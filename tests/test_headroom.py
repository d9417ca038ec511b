"""The share of headroom a learned scorer captures and its bootstrap intervals (foresight.eval.headroom)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from foresight.eval.headroom import TraceScore, headroom, paired_gain, resample_weights
from foresight.eval.metric_registry import TokenSet
from studies.__main__ import main as studies_main

B = 128
TOKENS = (100, 50, 80)  # scored tokens of the three traces
FULL = (50.0, 20.0, 40.0)  # their summed full-cache NLL


def scores(policy: str, evicted: tuple[float, ...], damaged=(0, 0, 0), tokens=TOKENS, budget=B) -> list[TraceScore]:
    return [
        TraceScore(policy, budget, i, "src", n, e, f, 80, d)
        for i, (n, e, f, d) in enumerate(zip(tokens, evicted, FULL, damaged))
    ]


RUN = [
    *scores("full", FULL),
    *scores("golden", (55.0, 22.0, 44.0)),  # ratio 121 / 110 = 1.1
    *scores("h2o", (70.0, 25.0, 48.0), damaged=(4, 1, 3)),  # 143 / 110 = 1.3
    *scores("snapkv", (75.0, 30.0, 60.0), damaged=(2, 1, 1)),  # 165 / 110 = 1.5, least damage
    *scores("raas", (51.0, 21.0, 41.0), tokens=(60, 20, 40)),  # scored on other tokens: never the best heuristic
    *scores("foresight", (60.0, 24.0, 48.0), damaged=(1, 0, 1)),  # 132 / 110 = 1.2: half the headroom
]


def test_share_of_headroom_by_hand():
    result = headroom(RUN, B, "foresight")
    assert (result.best_heuristic, result.least_damaging_heuristic, result.traces) == ("h2o", "snapkv", 3)
    assert result.loss_ratio["golden"].value == pytest.approx(1.1)
    assert result.loss_ratio["foresight"].value == pytest.approx(1.2)
    assert result.share.value == pytest.approx(0.5)
    assert result.ratio_gain.value == pytest.approx(0.1)
    assert result.damage["h2o"].value == pytest.approx(8 / 240)
    assert result.damage_gain.value == pytest.approx(4 / 240 - 2 / 240)
    assert "raas" not in result.loss_ratio and "full" not in result.loss_ratio
    for estimate in (result.share, result.ratio_gain, result.damage_gain, *result.loss_ratio.values()):
        assert estimate.low <= estimate.value <= estimate.high
    text = result.markdown()
    assert "best heuristic: h2o" in text and "captured by foresight: 50.0% [" in text


def test_intervals_equal_a_loop_over_the_resampled_traces():
    """The reference: draw the same resamples, pool each by plain sums, take the percentiles."""
    result = headroom(RUN, B, "foresight", seed=3, resamples=500)
    weights = resample_weights(3, 500, seed=3)
    table = {(s.policy, s.index): s for s in RUN}
    shares = []
    for row in weights[1:]:
        drawn = [i for i in range(3) for _ in range(int(row[i]))]

        def ratio(policy):
            return sum(table[policy, i].nll_evicted for i in drawn) / sum(table[policy, i].nll_full for i in drawn)

        shares.append((ratio("h2o") - ratio("foresight")) / (ratio("h2o") - ratio("golden")))
    low, high = np.percentile(shares, [2.5, 97.5])
    assert (result.share.low, result.share.high) == pytest.approx((low, high))
    assert weights[1:].sum(axis=1).tolist() == [3] * 500  # each resample draws as many traces as the sample


def test_identical_traces_give_intervals_of_zero_width():
    policies = [("golden", 5.5), ("h2o", 6.5), ("foresight", 6.0)]
    same = [TraceScore(p, B, i, "src", 10, e, 5.0, 80, 0) for p, e in policies for i in range(3)]
    result = headroom(same, B, "foresight")
    assert (result.share.low, result.share.value, result.share.high) == pytest.approx((0.5, 0.5, 0.5))


def test_nothing_to_compare_gives_none():
    assert headroom([s for s in RUN if s.policy != "golden"], B, "foresight") is None
    assert headroom(RUN, B, "foresight:other") is None
    assert headroom(RUN, 256, "foresight") is None
    assert headroom([s for s in RUN if s.policy in ("golden", "foresight", "raas")], B, "foresight") is None


def test_rows_off_the_reference_list_are_never_the_best_heuristic():
    """A second scorer's row (named freely by `--scorer NAME=DIR`) and a heuristic off the fixed list (knorm)
    beat h2o; neither counts, on any set: the reference is one list, not the set's best row after the fact."""
    run = [*RUN, *scores("shipped", (58.0, 23.0, 46.0)), *scores("knorm", (57.0, 23.0, 46.0))]
    result = headroom(run, B, "foresight", other_learned=("shipped", "foresight"))
    assert (result.best_heuristic, result.share.value) == ("h2o", pytest.approx(0.5))
    assert "shipped" in result.loss_ratio and "knorm" in result.loss_ratio  # still reported beside the others
    assert headroom(run, B, "foresight", reference=("knorm",)).best_heuristic == "knorm"
    assert "tova" in result.missing_reference and "not run: " in result.markdown()
    assert headroom(run, B, "foresight", reference=("tova",)) is None  # nothing of the list was run


def test_the_best_heuristic_is_chosen_again_in_every_resample():
    """h2o is best on trace 0, snapkv on traces 1 and 2: a resample's best is whichever pools lower on its
    draws, so the interval of the share is that of a loop choosing the best per resample."""
    run = [
        *scores("golden", (55.0, 22.0, 44.0)),
        *scores("h2o", (60.0, 40.0, 70.0)),  # 170 / 110
        *scores("snapkv", (90.0, 24.0, 48.0)),  # 162 / 110: best on the sample
        *scores("foresight", (58.0, 23.0, 47.0)),
    ]
    result = headroom(run, B, "foresight", seed=1, resamples=400)
    assert result.best_heuristic == "snapkv"
    table = {(s.policy, s.index): s for s in run}
    shares, held = [], []
    for row in resample_weights(3, 400, seed=1)[1:]:
        drawn = [i for i in range(3) for _ in range(int(row[i]))]

        def ratio(policy):
            return sum(table[policy, i].nll_evicted for i in drawn) / sum(table[policy, i].nll_full for i in drawn)

        best = min(ratio("h2o"), ratio("snapkv"))
        shares.append((best - ratio("foresight")) / (best - ratio("golden")))
        held.append((ratio("snapkv") - ratio("foresight")) / (ratio("snapkv") - ratio("golden")))
    assert (result.share.low, result.share.high) == pytest.approx(tuple(np.percentile(shares, [2.5, 97.5])))
    assert sum(a != pytest.approx(b) for a, b in zip(shares, held)) > 40  # h2o wins many resamples


def test_each_token_set_is_compared_on_its_own_scores():
    """Scores of the generated tokens alone give their own headroom; the all-token scores are not read."""
    generated = [
        replace(s, token_set="generated", nll_evicted=s.nll_full + (s.nll_evicted - s.nll_full) / 2) for s in RUN
    ]
    result = headroom([*RUN, *generated], B, "foresight", token_set="generated")
    assert result.token_set.value == "generated" and result.share.value == pytest.approx(0.5)
    assert result.loss_ratio["golden"].value == pytest.approx(1.05)  # half the all-token damage
    assert headroom(RUN, B, "foresight", token_set="prompt") is None
    with pytest.raises(ValueError, match="unknown token set 'reasoning'; allowed: 'all', 'prompt', 'generated'"):
        headroom(RUN, B, "foresight", token_set="reasoning")


def _eval_folder(path, entries) -> None:
    import json
    from dataclasses import asdict

    path.mkdir(parents=True)
    (path / "traces.json").write_text(json.dumps([asdict(entry) for entry in entries]))


def test_ablation_merges_evaluations_and_compares_every_scorer_with_one_best_heuristic(tmp_path):
    from studies.ablation.report import ablation_report, merged_scores

    base = [s for s in RUN if s.policy != "foresight"]
    _eval_folder(tmp_path / "base", base)
    _eval_folder(tmp_path / "first", [*scores("golden", (55.0, 22.0, 44.0)), *scores("first", (60.0, 24.0, 48.0))])
    _eval_folder(tmp_path / "second", scores("second", (65.5, 24.5, 53.0)))  # 143 / 110 = 1.3: no gain
    folders = (tmp_path / "base", tmp_path / "first", tmp_path / "second")
    merged = merged_scores(folders)
    assert len(merged) == len(base) + 6  # golden, scored twice alike, counts once
    report = ablation_report((("set", folders),), (("first", "a"), ("second", "b")), B)
    assert "best heuristic h2o" in report
    table, paired = report.split("Paired against first")
    rows = {
        line.split(" | ")[0].strip("| "): line
        for line in table.splitlines()
        if line.startswith("| first") or line.startswith("| second")
    }
    assert "| 50.0% [" in rows["first"] and "| 0.0% [" in rows["second"]
    assert headroom(merged, B, "first", ["second"]).share.value == pytest.approx(0.5)
    assert "| -0.1000 [" in rows["second"]  # first − second: 1.2 − 1.3 on the same traces, paired
    gain = paired_gain(merged, B, "second", "first")
    assert gain.value == pytest.approx(0.1) and gain.low <= gain.value <= gain.high
    (second,) = [line for line in paired.splitlines() if line.startswith("| second")]
    assert second.startswith("| second | 0.1000 [") and second.endswith("| – | – |")  # no −R, no flips: dashes
    assert paired_gain(merged, B, "first", "raas") is None  # no trace scored on the same tokens
    older = tmp_path / "older"  # a traces.json written before −R's sums were kept: NaN there, taken from the other
    _eval_folder(older, [replace(s, squared_sum=math.nan) for s in scores("golden", (55.0, 22.0, 44.0))])
    _eval_folder(tmp_path / "newer", [replace(s, squared_sum=2.0) for s in scores("golden", (55.0, 22.0, 44.0))])
    for order in ((older, tmp_path / "newer"), (tmp_path / "newer", older)):
        assert {s.squared_sum for s in merged_scores(order) if s.policy == "golden"} == {2.0}
    _eval_folder(tmp_path / "other", scores("golden", (56.0, 22.0, 44.0)))  # not the same traces
    with pytest.raises(ValueError, match="golden at B = 128 on trace 0 differs"):
        merged_scores((tmp_path / "base", tmp_path / "other"))
    with pytest.raises(ValueError, match="holds no traces.json"):
        merged_scores((tmp_path / "missing",))


def test_relative_change_of_a_figure_is_paired_over_the_same_resamples():
    """−R's relative change: (Σ ΔL² / Σ low-entropy) of the other over the reference's, minus 1, on each resample;
    by hand for the sample, and against a loop over the same resampled traces for the interval."""
    squared = {"first": (8.0, 2.0, 6.0), "second": (4.0, 3.0, 3.0)}
    run = [replace(s, squared_sum=squared[name][s.index]) for name in squared for s in scores(name, FULL)]
    change = paired_gain(run, B, "first", "second", "low_entropy_penalty", seed=1, resamples=300, relative=True)
    assert change.value == pytest.approx(10 / 16 - 1)
    weights = resample_weights(3, 300, seed=1)[1:]
    loop = [(weights_row @ squared["second"]) / (weights_row @ squared["first"]) - 1 for weights_row in weights]
    assert (change.low, change.high) == pytest.approx(tuple(np.percentile(loop, [2.5, 97.5])))
    assert paired_gain(run, B, "first", "third", relative=True) is None


def test_ablation_pools_sets_whose_trace_indices_collide(tmp_path):
    """Two sets with traces 0-2 each pool into one set of 6 traces, its figures the sums over both."""
    from studies.ablation.report import SET_STRIDE, ablation_report, pooled_scores

    _eval_folder(tmp_path / "a", RUN)
    _eval_folder(tmp_path / "b", RUN)
    sets = (("a", (tmp_path / "a",)), ("b", (tmp_path / "b",)), ("c", (tmp_path / "a",)))
    report = ablation_report(sets, (("foresight", "x"),), B, pooled=("a", "b"))
    assert "**pooled over a + b**: 6 traces, B = 128; best heuristic h2o" in report
    pooled = pooled_scores([RUN, RUN])
    assert sorted({s.index for s in pooled}) == [0, 1, 2, SET_STRIDE, SET_STRIDE + 1, SET_STRIDE + 2]
    result = headroom(pooled, B, "foresight")
    assert result.traces == 6 and result.share.value == pytest.approx(0.5)  # the same sums, twice
    assert (
        result.share.high - result.share.low
        <= headroom(RUN, B, "foresight").share.high - headroom(RUN, B, "foresight").share.low
    )
    with pytest.raises(ValueError, match="--pool names 'd', which is not a set; the sets are: a, b, c"):
        ablation_report(sets, (("foresight", "x"),), B, pooled=("d",))
    with pytest.raises(ValueError, match="cannot be pooled across sets"):
        pooled_scores([[TraceScore("h2o", B, SET_STRIDE, "src", 1, 1.0, 1.0, 1, 0)]])
    out = tmp_path / "report.md"  # the same tables through `python -m studies ablation`, its command above them
    argv = [
        "ablation",
        "--set",
        f"a={tmp_path / 'a'}",
        "--set",
        f"b={tmp_path / 'b'}",
        "--learned",
        "foresight=x",
        "--pool",
        "a,b",
        "--out",
        str(out),
    ]
    assert studies_main(argv) == 0
    text = out.read_text()
    assert "<!-- ablation-B128:start -->" in text and "--pool a,b" in text and report.split("**b**")[0] in text


def test_baselines_tables_every_policy_against_the_learned_scorer(tmp_path):
    """Per policy: pooled figures, KV memory from results.json, and the learned scorer's paired gain (by hand:
    h2o 1.3 − foresight 1.2 = 0.1; damage 8/240 − 2/240); a policy scored on other tokens has none."""
    import json

    from studies.baselines.report import baselines_report, memory_rows, plot_path

    _eval_folder(tmp_path / "a", [s for s in RUN if s.policy != "foresight"])
    _eval_folder(tmp_path / "b", [s for s in RUN if s.policy in ("foresight", "golden")])
    rows = [
        {"policy": p, "budget": B, "interval": 32, "loss_ratio": 1.0, "kv_mib": mib}
        for p, mib in (("h2o", 2.5), ("raas", 4.0), ("foresight", 2.5))
    ]
    (tmp_path / "a" / "results.json").write_text(json.dumps([{**rows[0], "kv_mib": None}, rows[1]]))
    (tmp_path / "b" / "results.json").write_text(json.dumps([rows[0], rows[2]]))
    assert {(r["policy"], r["kv_mib"]) for r in memory_rows((tmp_path / "a", tmp_path / "b"))} == {
        ("h2o", 2.5),
        ("raas", 4.0),
        ("foresight", 2.5),  # the row that states its memory wins
    }
    _eval_folder(tmp_path / "c", scores("h2o", (70.0, 25.0, 48.0), budget=256))
    (tmp_path / "c" / "results.json").write_text(json.dumps([{**rows[0], "budget": 256, "kv_mib": 4.5}]))
    report = baselines_report(
        (("Set A", (tmp_path / "a", tmp_path / "b", tmp_path / "c")),), ("other", "foresight"), (B, 256), tmp_path
    )
    at_128, at_256 = report.split("B = 256")
    lines = {line.split(" | ")[0].strip("| "): line for line in at_128.splitlines() if line.startswith("| ")}
    gain = paired_gain(RUN, B, "h2o", "foresight")
    assert lines["h2o"].startswith("| h2o | 2.50 | 1.3000 [") and f"| {gain} |" in lines["h2o"]
    assert gain.value == pytest.approx(0.1)
    damage = paired_gain(RUN, B, "h2o", "foresight", "low_entropy_damage")
    assert damage.value == pytest.approx(8 / 240 - 2 / 240) and lines["h2o"].endswith(
        f"| {damage.value:.2%} [{damage.low:.2%}, {damage.high:.2%}] |"
    )
    assert lines["raas"].endswith("| other tokens | other tokens |") and lines["golden"].startswith("| golden | – |")
    assert lines["foresight"].endswith("| – | – |")
    assert "Learned row: foresight." in report
    assert at_256.startswith(", 3 traces; foresight did not run at this budget (no gains).")
    assert "| h2o | 4.50 | 1.3000 [" in at_256 and at_256.count("| – | – |") == 1
    assert plot_path(tmp_path, "Set A").read_bytes()[:4] == b"\x89PNG"
    out, folders = tmp_path / "baselines.md", ",".join(str(tmp_path / name) for name in "abc")
    argv = [
        "baselines",
        "--set",
        f"Set A={folders}",
        "--learned",
        "other",
        "--learned",
        "foresight",
        "--budgets",
        "128,256",
    ]
    assert studies_main([*argv, "--plot-dir", str(tmp_path / "plots"), "--out", str(out)]) == 0  # the same, as a study
    written = out.read_text()
    assert [line for line in written.splitlines() if line.startswith("| ")] == [
        line for line in report.splitlines() if line.startswith("| ")
    ]
    assert "python -m studies baselines --set" in written and plot_path(tmp_path / "plots", "Set A").is_file()
    with pytest.raises(ValueError, match="holds no results.json"):
        memory_rows((tmp_path / "missing",))
    with pytest.raises(ValueError, match="give the same plot file"):
        baselines_report((("Set A", (tmp_path / "a",)), ("set-a", (tmp_path / "a",))), ("foresight",), (B,), tmp_path)
    with pytest.raises(ValueError, match=r"set a: none of the learned rows \['foresight'\] was evaluated"):
        baselines_report((("a", (tmp_path / "a",)),), ("foresight",), (B,), tmp_path)
    with pytest.raises(ValueError, match="figure 'nope' is not one of: loss_ratio, low_entropy_damage"):
        paired_gain(RUN, B, "h2o", "foresight", "nope")


def test_ablation_reads_the_token_set_it_is_asked_for(tmp_path):
    """The same rows over generated tokens, where the learned scorer keeps three quarters of the headroom instead of
    half: `token_set` picks those sums for every figure, its name heads the report, and all tokens stay the default."""
    from studies.ablation.report import ablation_report

    generated = [replace(s, token_set="generated") for s in RUN if s.policy != "foresight"]
    generated += [replace(s, token_set="generated") for s in scores("foresight", (57.5, 23.0, 46.0))]  # 1.15
    _eval_folder(tmp_path / "run", [*RUN, *generated])
    sets = (("set", (tmp_path / "run",)),)
    assert "| 50.0% [" in ablation_report(sets, (("foresight", "x"),), B)
    report = ablation_report(sets, (("foresight", "x"),), B, token_set=TokenSet.GENERATED)
    assert report.startswith("Predictions of generated tokens") and "| 75.0% [" in report
