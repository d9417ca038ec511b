"""The label-agreement and label-oracles studies: Spearman's correlation against the textbook formula, a kind
against itself or a reversed copy, and the oracle table's pooling."""

from dataclasses import replace

import pytest
import torch

from foresight.labels import GoldenLabels
from studies.label_agreement import run as label_agreement
from studies.label_oracles import run as label_oracles


def test_spearman_is_one_minus_six_sum_of_squared_rank_gaps():
    generator = torch.Generator().manual_seed(0)
    first, second = torch.rand(20, generator=generator), torch.rand(20, generator=generator)
    gaps = [
        sorted(range(20), key=lambda i: first[i]).index(i) - sorted(range(20), key=lambda i: second[i]).index(i)
        for i in range(20)
    ]
    expected = 1 - 6 * sum(gap * gap for gap in gaps) / (20 * (20 * 20 - 1))
    assert label_agreement.spearman(first, second) == pytest.approx(expected, abs=1e-12)
    assert label_agreement.spearman(first, torch.zeros(20)) is None


def test_a_kind_agrees_with_itself_and_not_with_its_reverse():
    budget, interval = 6, 2
    generator = torch.Generator().manual_seed(1)
    candidates = torch.stack([torch.arange(budget) + 2 * step for step in range(3)])[:, None, None].to(torch.int32)
    alpha = torch.rand(3, 1, 1, budget, generator=generator)
    labels = GoldenLabels(candidates, alpha, budget, interval, num_tokens=14)
    rhos, first, overlaps = label_agreement.agreement(labels, labels)
    assert rhos == pytest.approx([1.0] * 3) and first == pytest.approx([1.0]) and overlaps == [1.0] * 3
    rhos, _, overlaps = label_agreement.agreement(labels, replace(labels, alpha=-alpha))
    assert rhos == pytest.approx([-1.0] * 3) and max(overlaps) < 1.0


def test_the_oracle_table_pools_every_kind_over_the_traces_all_scored(tmp_path):
    """label-oracles: golden rows only, on the traces every folder scored, paired against the first."""
    import json
    from dataclasses import asdict

    from foresight.eval.headroom import TraceScore

    runs = {"alpha": (3, 1.0), "value": (2, 1.5)}  # (traces scored, evicted NLL per trace)
    for kind, (count, nll) in runs.items():
        (tmp_path / kind).mkdir()
        scores = [TraceScore("golden", 8, i, "src", 10, nll * (i + 1), i + 1.0, 5, 0, 1) for i in range(count)]
        scores.append(TraceScore("h2o", 8, 0, "src", 10, 9.0, 1.0, 5, 0, 1))
        (tmp_path / kind / "traces.json").write_text(json.dumps([asdict(s) for s in scores]))
    report = label_oracles.run(label_oracles.Settings(run=tuple(f"{kind}={tmp_path / kind}" for kind in runs)))
    rows = report.splitlines()[4:]
    assert rows[0].startswith("| golden-alpha | 2 | 1.0000 [1.0000, 1.0000] |") and rows[0].endswith("| – |")
    assert rows[1].startswith("| golden-value | 2 | 1.5000 [1.5000, 1.5000] |")
    assert rows[1].endswith("| +0.5000 [+0.5000, +0.5000] |")
