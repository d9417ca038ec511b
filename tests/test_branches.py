"""Step-level branch groups (trainers/reinforcement/branches.py) against replays run from the first token with the branch's
eviction scripted at its step, rewards by loops, and the choice of steps, layers and seeds."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from foresight import cli
from foresight.commands.curves import read_scalars
from foresight.commands.rl import request as rl_request
from foresight.labels import compute_golden_labels
from foresight.metrics import thresholded_terms
from foresight.policies.foresight import Foresight
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from studies.__main__ import main as studies_main
from tests.rl_runs import L_, B, KillAtStep, Killed, random_trace, rl_args, rl_config
from tests.scorers import random_scorer
from trainers.cli import rl_cli_main
from trainers.data_stage import FrozenModel, make_labels
from trainers.reinforcement.branches import (
    BranchSettings,
    RewardSettings,
    WindowAgreement,
    branch_points,
    changing_steps,
    roll_out_branches,
    window_agreement,
)
from trainers.reinforcement.estimators import Estimator
from trainers.reinforcement.grpo import GRPOScorer
from trainers.reinforcement.rollouts import group_advantages
from trainers.reinforcement.stage import lightning_args as rl_lightning_args


@dataclass
class ScriptedStep(Foresight):
    """The deterministic learned policy, except that at eviction step `step` each layer of `evicted`
    ({layer: positions [1, Hkv, L]}) evicts exactly those positions."""

    step: int = 0
    evicted: dict[int, torch.Tensor] = field(default_factory=dict)

    def step_keep_scores(self, contexts):
        scores = super().step_keep_scores(contexts)
        if self._steps - 1 != self.step:  # step_observe has counted this step
            return scores
        for index, context in enumerate(contexts):
            if context.layer_idx in self.evicted:
                gone = (context.candidate_positions[..., None] == self.evicted[context.layer_idx][:, :, None, :]).any(
                    -1
                )
                scores[index] = (~gone).to(scores.dtype)
        return scores


def loop_window_reward(nll, full, entropy, first: int, window: range, threshold: float) -> float:
    """−mean over the window's low-entropy tokens of ΔL²·1[ΔL > η]; low-entropy: entropy at most the 0.8
    quantile (linear interpolation) of the trace's scored tokens (those from `first` on), by loops."""
    scored = entropy[first:]
    ordered = sorted(scored)
    position = 0.8 * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    cut = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    chosen = [t for t in window if entropy[t] <= cut]
    if not chosen:
        return 0.0
    return -sum((nll[t] - full[t]) ** 2 if nll[t] - full[t] > threshold else 0.0 for t in chosen) / len(chosen)


@pytest.mark.parametrize("layers", [None, 1])
def test_branch_rewards_equal_replays_that_differ_only_at_the_branch_step(llama, layers):
    """Every branch row's window losses equal a one-row replay from the first token under the deterministic
    policy with that row's recorded eviction scripted at the step (the branch ran K rows after its step, the
    reference one: float32 rounding, 1e-5); d_k = the branch's window reward minus the backbone's, by loops,
    the backbone being the plain deterministic replay; only the branch step's sampled layers are recorded."""
    trace, scorer = random_trace(llama, 90, seed=4), random_scorer(llama, B, L_)
    settings = BranchSettings(rows=3, chunks=2, steps=2, layers=layers)
    groups = roll_out_branches(
        llama, scorer, trace, settings, rows=range(3), seed=1, reward=RewardSettings(threshold=0.0)
    )
    assert len(groups) == 2
    cadence = EvictionConfig(B, L_, sinks=0, protect_prompt=False)
    ids, prefill = trace.input_ids, B + L_
    backbone = EvictionEngine(llama, Foresight(scorer=scorer), cadence).replay([ids], [prefill]).nll[0]
    full, entropy = trace.token_nll.tolist(), trace.token_entropy.tolist()
    first = prefill
    for group in groups:
        actions = group.actions
        after = int(actions.after[0])
        step = (after - (prefill - 1)) // L_
        assert after == prefill - 1 + step * L_ and actions.after.numel() == 1
        recorded = list(range(2)) if layers is None else list(actions.layers)
        assert actions.evicted.shape[:3] == (len(recorded), 1, 3) and len(recorded) == (layers or 2)
        window = range(after + 1, min(after + 1 + settings.chunks * L_, ids.numel() - 1))
        backbone_reward = loop_window_reward(backbone.tolist(), full, entropy, first, window, 0.0)
        for row in range(3):
            evicted = {layer: actions.evicted[index, 0, row][None] for index, layer in enumerate(recorded)}
            engine = EvictionEngine(llama, ScriptedStep(scorer=scorer, step=step, evicted=evicted), cadence)
            reference = engine.replay([ids], [prefill]).nll[0]
            reward = loop_window_reward(reference.tolist(), full, entropy, first, window, 0.0) - backbone_reward
            assert math.isclose(float(group.scores.reward[row]), reward, rel_tol=1e-3, abs_tol=1e-6), (step, row)
            ratio = sum(reference[t] for t in window) / sum(full[t] for t in window)
            assert math.isclose(float(group.scores.loss_ratio[row]), float(ratio), rel_tol=1e-5)
        assert len(set(group.scores.reward.tolist())) > 1  # the rows drew different evictions
        whole = loop_window_reward(backbone.tolist(), full, entropy, first, range(first, ids.numel() - 1), 1.5)
        assert group.backbone.reward == pytest.approx(
            whole, rel=1e-4, abs=1e-9
        )  # the paper's R (η = 1.5), not the run's
        scored = range(first, ids.numel() - 1)
        ratio = sum(float(backbone[t]) for t in scored) / sum(full[t] for t in scored)
        assert group.backbone.loss_ratio == pytest.approx(ratio, rel=1e-5)  # the deployed policy's own


def test_golden_swap_rows_keep_what_golden_keeps_and_score_like_any_row(llama):
    """The last row of each group evicts, in every sampled layer, no more of golden's kept set of that step than any
    sampled row (it drops golden's discards in the pool first); it is the same at any temperature, and its reward is that
    of its eviction replayed from the first token (as for a sampled row). Without labels, one line names what is missing."""
    trace, scorer = random_trace(llama, 90, seed=4), random_scorer(llama, B, L_)
    labels = compute_golden_labels(llama, trace.input_ids, B, L_, trace_index=trace.index)
    settings = BranchSettings(rows=4, chunks=2, steps=2, golden_swaps=1)
    groups = roll_out_branches(
        llama, scorer, trace, settings, rows=range(4), seed=1, reward=RewardSettings(threshold=0.0), labels=labels
    )
    colder = roll_out_branches(llama, scorer, trace, settings, rows=range(4), seed=1, temperature=0.3, labels=labels)
    kept = labels.kept_positions()
    cadence = EvictionConfig(B, L_, sinks=0, protect_prompt=False)
    for group in groups:
        actions, step = group.actions, (int(group.actions.after[0]) - (B + L_ - 1)) // L_
        swap = next(g for g in colder if torch.equal(g.actions.after, actions.after)).actions
        assert torch.equal(actions.evicted[:, :, 3], swap.evicted[:, :, 3])  # the swap row draws nothing
        for layer in range(2):
            overlaps = [
                sum(
                    int(position) in set(kept[step, layer, head].tolist())
                    for position in actions.evicted[layer, 0, row, head]
                )
                for row in range(4)
                for head in range(2)
            ]
            per_row = [sum(overlaps[row * 2 : row * 2 + 2]) for row in range(4)]
            assert per_row[3] <= min(per_row[:3]), (step, layer, per_row)
        evicted = {layer: actions.evicted[layer, 0, 3][None] for layer in range(2)}
        replay = EvictionEngine(llama, ScriptedStep(scorer=scorer, step=step, evicted=evicted), cadence)
        nll = replay.replay([trace.input_ids], [B + L_]).nll[0]
        window = range(int(actions.after[0]) + 1, min(int(actions.after[0]) + 1 + 2 * L_, trace.input_ids.numel() - 1))
        full, entropy = trace.token_nll.tolist(), trace.token_entropy.tolist()
        backbone = EvictionEngine(llama, Foresight(scorer=scorer), cadence).replay([trace.input_ids], [B + L_]).nll[0]
        expected = loop_window_reward(nll.tolist(), full, entropy, B + L_, window, 0.0) - loop_window_reward(
            backbone.tolist(), full, entropy, B + L_, window, 0.0
        )
        assert math.isclose(float(group.scores.reward[3]), expected, rel_tol=1e-3, abs_tol=1e-6)
    assert any(
        (group.actions.evicted[:, :, 3] != group.actions.evicted[:, :, 0]).any() for group in groups
    )  # the swap changed some eviction
    with pytest.raises(ValueError, match="branch_golden_swaps=1 needs golden labels for trace 4"):
        roll_out_branches(llama, scorer, trace, settings, rows=range(4))
    with pytest.raises(ValueError, match="branch_golden_swaps=4 must be 0..3"):
        BranchSettings(rows=4, golden_swaps=4)


def test_a_branch_row_is_the_same_in_any_split_of_the_group(llama):
    """Rows 2 and 3 of a group of 4 rolled out alone equal those rows of the whole group (how a group splits
    across processes); the steps and layers branched at depend on (seed, round, trace) only."""
    trace, scorer = random_trace(llama, 80, seed=5), random_scorer(llama, B, L_)
    settings = BranchSettings(rows=4, chunks=1, steps=2, layers=1)
    whole = roll_out_branches(
        llama, scorer, trace, settings, rows=range(4), seed=3, round_index=2, reward=RewardSettings(threshold=0.0)
    )
    part = roll_out_branches(
        llama, scorer, trace, settings, rows=[2, 3], seed=3, round_index=2, reward=RewardSettings(threshold=0.0)
    )
    for mine, theirs in zip(whole, part, strict=True):
        assert torch.equal(mine.actions.after, theirs.actions.after) and mine.actions.layers == theirs.actions.layers
        assert torch.equal(mine.actions.order[:, :, 2:], theirs.actions.order)
        torch.testing.assert_close(mine.scores.reward[2:], theirs.scores.reward, rtol=0, atol=1e-6)


def test_branch_steps_are_drawn_among_the_steps_that_change_a_prediction():
    # B + L = 20 tokens prefilled: step j runs after position 19 + 4j and must precede position T - 2.
    assert [changing_steps(length, B + L_ - 1, L_) for length in (21, 22, 25, 26, 27)] == [0, 1, 1, 2, 2]
    assert changing_steps(40, 30, L_) == 2  # after a decode compression at P - 1 = 30: steps after 30 and 34
    points = [branch_points(10, 3, seed=0, round_index=r, trace_index=1) for r in range(20)]
    assert all(p == sorted(set(p)) and len(p) == 3 and all(0 <= s < 10 for s in p) for p in points)
    assert len({tuple(p) for p in points}) > 5 and branch_points(2, 5, 0, 0, 0) == [0, 1]
    with pytest.raises(ValueError, match="need branch_rows >= 2, branch_chunks >= 1"):
        BranchSettings(rows=1)


def test_rl_with_branch_groups_trains_records_its_settings_and_resumes(
    tmp_path, tiny_dir, traces_dir, start_scorer, capsys
):
    """`model.rollout: branch` through `foresight rl`: the scorer moves, the branch settings and the estimator's
    rules are in the checkpoint's hyper-parameters and on the card, the deterministic backbone's reward is
    logged, and a run killed after step 2 and resumed from last.ckpt ends with the weights of one run through."""
    branch = {"rollout": "branch", "branch_rows": 4, "branch_chunks": 2, "branch_steps": 2, "branch_layers": 1}
    config = rl_config(
        tmp_path / "rl.yaml",
        tiny_dir,
        traces_dir,
        trainer={"max_steps": 3},
        model=branch,
        checkpoint={"every_n_train_steps": 1},
    )
    whole = tmp_path / "whole"
    assert cli.main(rl_args(config, start_scorer, whole)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "scorer refined by GRPO for 3 steps" in last and "train/backbone_reward " in last
    hparams = torch.load(whole / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert {name: hparams[name] for name in branch} == branch
    assert (hparams["reward_rule"], hparams["advantage_rule"], hparams["logprob_rule"]) == (
        "thresholded",
        "group_normalised",
        "order",
    )
    card = (whole / "scorer" / "README.md").read_text()
    assert "step-level branch groups: K = 4 rows at 2 eviction steps per trace, sampled on 1 layers per group" in card
    assert "reward rule thresholded, advantage rule group_normalised, log-probability rule order" in card
    start = load_file(start_scorer / "model.safetensors")
    final = load_file(whole / "scorer" / "model.safetensors")
    assert any(not torch.equal(tensor, start[name]) for name, tensor in final.items())
    split = tmp_path / "split"
    args = rl_args(config, start_scorer, split)
    killed = rl_cli_main(rl_lightning_args(rl_request(cli.build_parser().parse_args(args)))[1:], run=False)
    killed.trainer.callbacks.append(KillAtStep(2))
    with pytest.raises(Killed):
        killed.trainer.fit(killed.model, datamodule=killed.datamodule)
    assert cli.main([*args, "--ckpt-path", "last"]) == 0
    for name, tensor in load_file(split / "scorer" / "model.safetensors").items():
        torch.testing.assert_close(tensor, final[name], rtol=0, atol=1e-6)


def test_rl_with_golden_swaps_reads_the_traces_labels(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    """Without the training traces' labels a branch run with a golden-swap row stops before any rollout, in one
    line; once they are made it trains and records the option."""
    labelled = tmp_path / "traces"
    shutil.copytree(traces_dir, labelled, ignore=shutil.ignore_patterns("labels-*"))
    swaps = {"rollout": "branch", "branch_rows": 3, "branch_chunks": 1, "branch_steps": 1, "branch_golden_swaps": 1}
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, labelled, trainer={"max_steps": 1}, model=swaps)
    capsys.readouterr()
    assert cli.main(rl_args(config, start_scorer, tmp_path / "refused")) == 2
    error = capsys.readouterr().err.strip()
    assert "branch_golden_swaps=1 needs golden labels for every training trace;" in error and "\n" not in error
    make_labels(FrozenModel(str(tiny_dir)), labelled, B, L_, progress=False)
    assert cli.main(rl_args(config, start_scorer, tmp_path / "out")) == 0
    hparams = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert hparams["branch_golden_swaps"] == 1 and "scorer refined by GRPO for 1 steps" in capsys.readouterr().out


def test_bad_branch_and_estimator_options_are_one_line_errors(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    config = rl_config(tmp_path / "rl.yaml", tiny_dir, traces_dir)
    cases = [
        ("model.rollout=vine", "unknown rollout 'vine'; allowed: 'episode', 'branch'"),
        ("model.advantage_rule=self_critical", "advantage_rule self_critical needs rollout: branch"),
        ("model.kl_stop=0", "kl_target and kl_stop must be finite numbers > 0 or null, got None, 0.0"),
        ("model.kl_target=-1", "kl_target and kl_stop must be finite numbers > 0 or null, got -1.0, None"),
        ("model.branch_layers=99", "branch_layers=99 is more layers than the model's 2: give 1..2, or null"),
        ("model.beta_floor=0.5", "beta_floor=0.5 must be > 0 and at most beta=0.05: β halves down to it"),
        (
            "model.branch_rows=1",
            "need branch_rows >= 2, branch_chunks >= 1 (or null), branch_steps >= 1 and branch_layers >= 1",
        ),
        ("model.reward_rule=dense9", "unknown reward_rule 'dense9'; allowed: 'thresholded'"),
        ("model.advantage_rule=none", "unknown advantage_rule 'none'; allowed: 'group_normalised'"),
        ("model.logprob_rule=sets", "unknown logprob_rule 'sets'; allowed: 'order'"),
        ("model.branch_golden_swaps=1", "branch_golden_swaps=1 needs rollout: branch, got episode"),
        ("model.rollout=branch model.branch_golden_swaps=8", "branch_golden_swaps=8 must be 0..7"),
    ]
    capsys.readouterr()
    for override, message in cases:
        assert cli.main(rl_args(config, start_scorer, tmp_path / "out", *override.split())) == 2, message
        error = capsys.readouterr().err.strip()
        assert message in error and error.count("\n") == 0, error


def test_window_agreement_reads_each_branch_over_its_window_and_the_whole_rest(llama):
    """The window check's d_k over W chunks equal the rewards `roll_out_branches` gives the same draws at that W
    (continuing a branch changes no loss inside its window), and over the rest those at a W past the trace's end
    (where window and rest coincide); every reward rule asked is scored."""
    trace, scorer = random_trace(llama, 90, seed=4), random_scorer(llama, B, L_)
    settings = BranchSettings(rows=3, chunks=2, steps=2)
    rules = {"thresholded": thresholded_terms, "dense": Estimator("dense").damage_terms}
    agreements = window_agreement(
        llama, scorer, trace, settings, (1, 2, 40), rules, seed=1, reward=RewardSettings(threshold=0.0)
    )
    assert [(a.rule, a.chunks) for a in agreements[:3]] == [("thresholded", 1), ("thresholded", 2), ("thresholded", 40)]
    assert len(agreements) == 2 * 2 * 3  # rules × branch groups × windows
    dense = RewardSettings(threshold=0.0, terms=rules["dense"])

    def branch_groups(chunks: int | None):
        return roll_out_branches(llama, scorer, trace, BranchSettings(3, chunks, 2), range(3), seed=1, reward=dense)

    for chunks in (1, 2, 40):
        groups = branch_groups(chunks)
        chosen = [a for a in agreements if a.rule == "dense" and a.chunks == chunks]
        for group, agreement in zip(groups, chosen, strict=True):
            assert agreement.step == int(group.actions.after[0] - (B + L_ - 1)) // L_
            torch.testing.assert_close(agreement.window, group.scores.reward, rtol=0, atol=1e-6)
            if chunks == 40:  # 160 tokens: past the end of a 90-token trace
                torch.testing.assert_close(agreement.rest, group.scores.reward, rtol=0, atol=1e-6)
                assert agreement.spearman == pytest.approx(1.0) or math.isnan(agreement.spearman)
    to_the_end = branch_groups(None)  # branch_chunks null: rewarded over the whole rest of the trace
    rests = [a.rest for a in agreements if a.rule == "dense" and a.chunks == 40]
    for group, rest in zip(to_the_end, rests, strict=True):
        torch.testing.assert_close(group.scores.reward, rest, rtol=0, atol=1e-6)


def test_window_agreement_spearman_by_hand():
    one = torch.tensor([0.1, 0.3, 0.2, 0.2])
    assert WindowAgreement(0, 0, "dense", 1, one, torch.tensor([1.0, 3.0, 2.0, 2.0])).spearman == pytest.approx(1.0)
    # ranks 1, 4, 2.5, 2.5 against 4, 1, 2.5, 2.5: covariance −4.5 over a variance of 4.5 each
    assert WindowAgreement(0, 0, "dense", 1, one, torch.tensor([3.0, 1.0, 2.0, 2.0])).spearman == pytest.approx(-1.0)
    assert math.isnan(WindowAgreement(0, 0, "dense", 1, one, torch.zeros(4)).spearman)


def test_rl_window_bench_reports_each_rule_and_window(tmp_path, traces_dir, start_scorer, capsys):
    out = tmp_path / "bench.md"
    args = ["rl-window", "--traces", str(traces_dir), "--count", "2", "--scorer", str(start_scorer)]
    args += [
        "--chunks",
        "1,100",
        "--branch-rows",
        "3",
        "--sample-temperature",
        "1",
        "--damage-threshold",
        "0",
        "--out",
        str(out),
    ]
    assert studies_main(args) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert [(row[0], row[1]) for row in rows[1:]] == [
        (f"| {rule}", width) for rule in ("thresholded", "dense", "gated") for width in ("1", "100")
    ]
    for row in rows[1:]:
        if row[1] == "100":  # the window holds the whole rest: the rankings agree wherever defined
            assert row[3] in ("1.000", "nan") and (row[3] == "nan" or row[-1] == "yes |")


def test_anchored_rl_options_are_recorded_logged_and_checkpointed_every_epoch(
    tmp_path, tiny_dir, traces_dir, start_scorer, capsys
):
    """Branch groups with self-critical advantages, the gated reward and an adaptive β: the options are in the
    hyper-parameters and on the card with the stopping rule, the KL is logged per set and per branch point
    (2 sets here: 1 layer × 2 KV heads), the backbone's loss ratio is logged, β doubled after the steps whose KL
    exceeded 1.5·kl_target and is saved with the checkpoints, and every epoch leaves its checkpoint."""
    options = {
        "rollout": "branch",
        "branch_rows": 4,
        "branch_chunks": 2,
        "branch_steps": 1,
        "branch_layers": 1,
        "advantage_rule": "self_critical",
        "reward_rule": "gated",
        "damage_gate_width": 0.3,
        "kl_target": 1e-6,
    }
    config = rl_config(
        tmp_path / "rl.yaml",
        tiny_dir,
        traces_dir,
        trainer={"max_steps": -1, "max_epochs": 2},
        model=options,
        data={"batch_size": 4},
    )
    run = tmp_path / "run"
    assert cli.main(rl_args(config, start_scorer, run)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "scorer refined by GRPO for 4 steps" in last  # 8 training traces, 2 batches per epoch
    logged = {name: float(last.split(f"train/{name} ")[1].split(",")[0]) for name in ("kl_per_set", "kl_per_step")}
    assert logged["kl_per_set"] > 0 and logged["kl_per_step"] == pytest.approx(2 * logged["kl_per_set"], rel=1e-5)
    assert "train/backbone_loss_ratio " in last and "train/backbone_reward " in last
    assert sorted(path.name for path in (run / "checkpoints").glob("epoch-*.ckpt")) == ["epoch-0.ckpt", "epoch-1.ckpt"]
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert {name: checkpoint["hyper_parameters"][name] for name in options} == options
    # step 1 rolls out the start itself (KL 0: β stays 0.05); every later step's KL exceeds 1.5e-6
    assert checkpoint["kl_beta"] == pytest.approx(0.05 * 2**3)
    card = (run / "scorer" / "README.md").read_text()
    assert "reward rule gated (w = 0.3), advantage rule self_critical" in card
    assert "β adapted from 0.05 to hold the KL per (layer, KV head) set near 1e-06 nats" in card
    assert "stops after 2 epochs" in card


def test_kl_stop_ends_the_run_after_the_first_step_past_it(tmp_path, tiny_dir, traces_dir, start_scorer, capsys):
    """Step 1 rolls out the start (KL 0); a KL stop of 1e-9 nats per set ends the run after the first step whose
    rollouts' policy had moved, long before max_steps; the card names the rule."""
    config = rl_config(
        tmp_path / "rl.yaml",
        tiny_dir,
        traces_dir,
        trainer={"max_steps": 6},
        model={"rollout": "branch", "branch_rows": 2, "branch_chunks": 1, "branch_steps": 1, "kl_stop": 1e-9},
    )
    assert cli.main(rl_args(config, start_scorer, tmp_path / "run")) == 0
    kl = read_scalars(tmp_path / "run")["train/kl_per_set"]
    moved = min(step for step, value in kl.items() if value > 1e-9)
    assert 0 < moved < 5 and sorted(kl) == list(range(moved + 1))  # the start's step logs 0; none after the stop
    assert f"scorer refined by GRPO for {moved + 1} steps" in capsys.readouterr().out.strip().splitlines()[-1]
    card = (tmp_path / "run" / "scorer" / "README.md").read_text()
    assert "β fixed at 0.05; stops after 6 steps or the first step whose KL per set exceeds 1e-09 nats" in card


def test_adaptive_beta_doubles_above_the_band_halves_below_it_and_resumes(tiny_dir, start_scorer):
    """PPO's rule around kl_target = 1: ×2 above 1.5, ÷2 below 1/1.5, never below the configured β; the β a
    checkpoint saved is the one a resumed run continues with (a checkpoint from before β adapted: the config's)."""
    module = GRPOScorer(str(start_scorer), B, L_, model=str(tiny_dir), beta=0.01, kl_target=1.0, rollout="branch")
    seen = []
    for kl in (2.0, 1.6, 1.2, 0.5, 0.6, 0.1, 0.1):
        module._control_kl(kl)
        seen.append(module.current_beta())
    assert seen == pytest.approx([0.02, 0.04, 0.04, 0.02, 0.01, 0.01, 0.01])
    module.on_load_checkpoint({"kl_beta": 0.32})
    assert module.current_beta() == 0.32
    module.on_load_checkpoint({})
    assert module.current_beta() == 0.01


def test_a_beta_floor_lets_a_kl_far_below_its_target_loosen_the_anchor(tiny_dir, start_scorer):
    """With beta_floor below β, steps far under the KL target halve β down to the floor (and no further); the
    model card states the floor."""
    module = GRPOScorer(
        str(start_scorer), B, L_, model=str(tiny_dir), beta=1.0, kl_target=0.5, beta_floor=0.01, rollout="branch"
    )
    seen = []
    for _ in range(9):
        module._control_kl(0.01)
        seen.append(module.current_beta())
    assert seen == pytest.approx([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.01, 0.01, 0.01])
    assert "never below 0.01" in module.stage_settings()["KL control"]


def test_self_critical_scales_every_group_of_a_step_by_the_batch_rms(tiny_dir, start_scorer):
    """The module's advantages of a step's branch groups: d_k over the rms of every d of the batch with
    `self_critical` (a 1e-4 group keeps 1e-4 of the push), Eq. 9 per group otherwise (both groups ±1-sized)."""
    rewards = torch.tensor([[0.0, -5.0, 1.0, 0.0], [1e-4, -1e-4, 0.0, 0.0]])
    groups = [SimpleNamespace(scores=SimpleNamespace(credited=lambda credit, d=d: d)) for d in rewards]
    rms = float(rewards.square().mean().sqrt())
    for rule, expected in (
        ("self_critical", rewards / (rms + 1e-8)),
        ("group_normalised", torch.stack([group_advantages(d) for d in rewards])),
    ):
        module = GRPOScorer(str(start_scorer), B, L_, model=str(tiny_dir), rollout="branch", advantage_rule=rule)
        module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
        credited = list(module._credited(groups))
        assert [group for group, _ in credited] == groups
        torch.testing.assert_close(torch.stack([a for _, a in credited]), expected, rtol=1e-6, atol=1e-12)
    assert float(expected[1].abs().max()) > 0.9  # Eq. 9 pushes the 1e-4 group as hard as the 5-nat one
