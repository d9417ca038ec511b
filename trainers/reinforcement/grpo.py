"""The reinforcement stage as a LightningModule: GRPO on the learned scorer (ForesightKV §3.3 Eqs. 7-10,
App. E.1; docs/algorithms.md §7).

Every training step takes a batch of traces (`trainers.reinforcement.data`), rolls each out G times with the
current scorer sampling its evictions (`trainers.reinforcement.rollouts.roll_out_together`, the frozen model under
no_grad, `traces_per_replay` traces' groups per replay),
normalises the rewards within each trace's group (Eq. 9), then minimises minus Eq. 10: the clipped
ratio objective with the advantage broadcast to every eviction (step, layer, KV head) of the rollout
(or, with `credit: reward_to_go`, each step's own advantage from the damage to the tokens after it),
plus β times the k3 estimate of KL(π_θ ‖ π_ref) to a frozen copy of the starting scorer. Optimisation
is manual: Adam with a linear warm-up to a constant learning rate (the authors' code), the gradient
norm clipped, `epochs` updates on each batch of rollouts (1 in the paper: the batch is the mini-batch,
so the ratio is 1 at the update and clipping acts only with more epochs).

Under DDP the G rollouts of every trace are split across the ranks (each replays G / world of them),
the rewards are all-gathered so each group is normalised whole, and the gradients are averaged by an
explicit all-reduce after every backward (several backward passes per step, one per trace), so N
ranks make the same update as one process. Only the scorer has trainable parameters: the frozen model
is held outside the module (never saved, never wrapped by DDP) and the reference scorer is frozen.

Size: one LightningModule; its training step, the DDP all-gathers and the KL reference belong together.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import MeanMetric

from foresight.cadence import Regime
from foresight.data.trace_store import Trace
from foresight.labels import LabelKind, LabelStore
from foresight.metrics import DAMAGE_EXPONENT, DAMAGE_OFFSET, DAMAGE_THRESHOLD, LOW_ENTROPY_SHARE
from foresight.models import describe, float_dtype, load_config
from foresight.scorer.eviction_sampling import check_temperature
from foresight.scorer.model import ForesightScorer, load_scorer, named_by_content
from trainers.data_stage import FrozenModel
from trainers.reinforcement.branches import BranchSettings, RewardSettings, roll_out_branches
from trainers.reinforcement.estimators import GATE_WIDTH, Estimator, LogprobRule
from trainers.reinforcement.rollouts import (
    CLIP_EPSILON,
    LOG_RATIO_CLAMP,
    Credit,
    EvictionActions,
    GroupRollout,
    LossReference,
    Rollout,
    full_cache_losses,
    grpo_objective,
    packs,
    roll_out_together,
    rollout_seeds,
)
from trainers.scorer_module import ScorerModule


class GRPOScorer(ScorerModule):
    """Refines a trained `ForesightScorer` with GRPO.

    scorer: the starting scorer, a folder or Hub id (`foresight fit` writes one); it is also π_ref.
    budget, interval: B and L of the rollouts (linked from the data); the scorer must have been trained
      for them. model: the frozen model that made the traces (linked from the data); the scorer must
      fit its shape.
    group_size: G, rollouts per trace (8). lr: Adam's learning rate after warm_up steps of linear
      warm-up (3e-4, 10). beta: β of the KL term (0.01 Qwen3-4B, 0.03 Qwen3-1.7B, 0.1 R1-Distill-7B);
      kl_steps: apply β only for the first kl_steps optimisation steps (the authors' code turns the KL
      off after 100 steps); None: always. clip: ε (0.2). epochs: updates per batch of rollouts (1).
      max_grad_norm: gradient norm clipping (1.0, the authors' code; None: none).
    temperature: τ of the rollouts' sampled policy, Eq. 2 over the keep scores divided by τ (1, the paper's).
      A supervised scorer's scores can be nearly equal over the pool (the ranking loss asks only for a
      margin), which makes the first draw uniform at τ = 1; a smaller τ keeps the rollouts near the
      scorer's own ranking, exploring around it. The exported scorer is used deterministically either way.
    low_entropy_share, damage_threshold, damage_exponent: the reward's bottom-entropy share (0.8), η (1.5)
      and p (2) of its damage term ΔL^p·1[ΔL > η].
    credit: "rollout" (the paper's): every eviction of a rollout gets the advantage of its reward;
      "reward_to_go": eviction step s gets the advantage of its reward-to-go (the damage to the tokens
      predicted after it only), normalised per step index across the G rollouts, so a step is not
      blamed for damage done before it.
    storage_dtype: dtype of the recorded scorer inputs between rollout and update ("float32"; "float16"
      or "bfloat16" halve the memory of long traces but round what the update scores against what was
      sampled). dtype: of the frozen model, which runs on the module's device.
    loss_reference: what the rollouts' token losses are compared with: "stored" (the trace's full-cache
      losses) or "replay" (the frozen model's own, in `dtype`, replayed once per trace and kept; with a
      dtype other than the one the traces were sampled in, `trainers.reinforcement.rollouts.LossReference`).
    traces_per_replay: the groups of this many traces of a batch replay together as the rows of one
      batch (`trainers.reinforcement.rollouts.roll_out_together`; 1: one trace per replay). The same rollouts either
      way; more rows per forward suit a GPU, where a replay of G rows leaves it idle.
    rollout: "episode" (the paper's): G rollouts per trace sampling every step; "branch": step-level branch
      groups (`trainers.reinforcement.branches`): one deterministic backbone replay per trace, and at branch_steps of its
      eviction steps, branch_rows rows (K) copied from its state that draw that step by Eq. 2 (on
      branch_layers layers per group, null: all) and continue deterministically for branch_chunks chunks (null: to the trace's end)
      (W), rewarded by the backbone's damage minus their own over those W·L tokens; the last
      branch_golden_swaps of the K rows do not sample but evict, in the sampled layers, what golden's kept set
      of that step keeps least among the same pool (`BranchSettings.golden_swaps`; the traces' α labels at B, L
      and the regime must exist, checked before the first rollout). group_size and traces_per_replay apply to
      episodes only.
    reward_rule, advantage_rule, logprob_rule: the estimator's rules by name (`trainers.reinforcement.estimators`):
      "thresholded" (the damage term ΔL^p·1[ΔL > η]), "group_normalised" (Eq. 9), "order" (Plackett-Luce of
      the sampled order), the paper's; or "dense" ((ΔL − δ)₊^p, δ = damage_offset), "gated" ((ΔL)₊^p·σ((ΔL −
      η) / w), w = damage_gate_width), "leave_one_out" (RLOO, unscaled), "self_critical" (branch groups only:
      d_k against the deterministic backbone over the batch's rms of d, so every group of the step shares one
      scale), "set" (the evicted set's probability, Kool et al. 2020). Episodes log R of §3.3 as
      `train/paper_reward` whatever the reward rule.
    kl_target: adapt β to hold the KL per (layer, KV head) set near this many nats (PPO's adaptive penalty,
      Schulman et al. 2017 §4: β doubles after a step whose KL per set exceeds 1.5·kl_target and halves after
      one below kl_target / 1.5, never below `beta_floor`); None: β fixed. beta_floor: the lowest β the
      adaptation may halve to (None: `beta` itself, the behaviour before 0.9.0, which lets β only rise; at most
      `beta`), so a KL far below its target can loosen the anchor. kl_stop: stop the run at the end of the
      first step whose KL per set exceeds it (a stopping rule fixed before any evaluation); None: never.
    seed: seeds every rollout's sampling with (seed, round, trace, row) (and the branch step).
    regime: where the rollouts' eviction steps fall (`foresight.cadence.Regime`: streaming or decode); None: the
      starting scorer's own. The refined scorer's config records it.
    """

    def __init__(
        self,
        scorer: str,
        budget: int,
        interval: int,
        model: str = "default",
        group_size: int = 8,
        lr: float = 3e-4,
        warm_up: int = 10,
        beta: float = 0.01,
        kl_steps: int | None = None,
        clip: float = CLIP_EPSILON,
        epochs: int = 1,
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        low_entropy_share: float = LOW_ENTROPY_SHARE,
        damage_threshold: float = DAMAGE_THRESHOLD,
        damage_exponent: float = DAMAGE_EXPONENT,
        credit: str = Credit.ROLLOUT.value,
        storage_dtype: str = "float32",
        dtype: str = "float32",
        loss_reference: str = LossReference.STORED.value,
        traces_per_replay: int = 1,
        rollout: str = Rollout.EPISODE.value,
        branch_rows: int = 8,
        branch_chunks: int | None = 4,
        branch_steps: int = 2,
        branch_layers: int | None = None,
        branch_golden_swaps: int = 0,
        reward_rule: str = "thresholded",
        advantage_rule: str = "group_normalised",
        logprob_rule: str = "order",
        damage_offset: float = DAMAGE_OFFSET,
        damage_gate_width: float = GATE_WIDTH,
        kl_target: float | None = None,
        beta_floor: float | None = None,
        kl_stop: float | None = None,
        seed: int = 0,
        regime: str | None = None,
    ) -> None:
        super().__init__()
        self.rollout = Rollout.parse(rollout)
        self.branches = BranchSettings(branch_rows, branch_chunks, branch_steps, branch_layers, branch_golden_swaps)
        if branch_golden_swaps and self.rollout is not Rollout.BRANCH:
            raise ValueError(
                f"branch_golden_swaps={branch_golden_swaps} needs rollout: branch, got {self.rollout.value}"
            )
        self.estimator = Estimator(reward_rule, advantage_rule, logprob_rule, damage_offset, damage_gate_width)
        if self.estimator.batch_wide and self.rollout is not Rollout.BRANCH:
            raise ValueError(
                f"advantage_rule {advantage_rule} needs rollout: branch (its baseline is the deterministic backbone's "
                f"reward), got rollout: {self.rollout.value}"
            )
        if any(bound is not None and not 0 < bound < float("inf") for bound in (kl_target, kl_stop)):
            raise ValueError(f"kl_target and kl_stop must be finite numbers > 0 or null, got {kl_target}, {kl_stop}")
        if kl_target is not None and beta <= 0:
            raise ValueError(f"kl_target adapts β from beta, which must then be > 0, got beta={beta}")
        if beta_floor is not None and not 0 < beta_floor <= beta:
            raise ValueError(f"beta_floor={beta_floor} must be > 0 and at most beta={beta}: β halves down to it")
        if group_size < 2:
            raise ValueError(
                f"group_size G must be at least 2 (the advantage normalises rewards within a group), got {group_size}"
            )
        if lr <= 0 or beta < 0 or not 0 < clip < 1 or epochs < 1 or warm_up < 0:
            raise ValueError(
                f"need lr > 0, beta >= 0, 0 < clip < 1, epochs >= 1 and warm_up >= 0, got lr={lr}, beta={beta}, "
                f"clip={clip}, epochs={epochs}, warm_up={warm_up}"
            )
        check_temperature(temperature)
        if traces_per_replay < 1:
            raise ValueError(f"traces_per_replay must be at least 1, got {traces_per_replay}")
        if not 0 <= damage_threshold < float("inf") or not 0 < damage_exponent < float("inf"):
            raise ValueError(
                f"need a finite damage_threshold >= 0 and damage_exponent > 0, got damage_threshold={damage_threshold}, "
                f"damage_exponent={damage_exponent}"
            )
        self.credit = Credit.parse(credit)
        self.loss_reference = LossReference.parse(loss_reference)
        self.save_hyperparameters()
        self.automatic_optimization = False
        start = load_scorer(scorer)
        trained = (start.config.budget, start.config.interval)
        if trained != (budget, interval):
            raise ValueError(
                f"scorer {scorer} was trained for B={trained[0]}, L={trained[1]}, but the rollouts use B={budget}, "
                f"L={interval}; train one for them or set data.budget and data.interval to match"
            )
        shape = describe(load_config(model))
        start.check_compatible(shape)
        if branch_layers is not None and branch_layers > shape.num_layers:
            raise ValueError(
                f"branch_layers={branch_layers} is more layers than the model's {shape.num_layers}: give 1.."
                f"{shape.num_layers}, or null for every layer"
            )
        config = dataclasses.replace(
            start.config,
            stage="reinforcement",
            started_from=named_by_content(start, scorer),
            regime=start.config.regime if regime is None else Regime.parse(regime),
        )
        self.scorer = ForesightScorer(config)
        self.scorer.load_state_dict(start.state_dict())
        self.reference = copy.deepcopy(self.scorer).requires_grad_(False)
        self.freeze_untrained()
        self.beta = beta  # β of the KL term now: adapted when kl_target is set, saved with the checkpoints
        self.storage_dtype = float_dtype("storage_dtype", storage_dtype)
        self.model_dtype = float_dtype("dtype", dtype)
        self._frozen: FrozenModel | None = None
        self._full_cache_nll: dict[int, torch.Tensor] = {}  # by trace index, with loss_reference "replay"
        self._golden: LabelStore | None = None  # the golden-swap rows' labels, opened by on_fit_start
        names = (
            "reward",
            "loss_ratio",
            "damage",
            "kl_per_set",
            "kl_per_step",
            "clip_fraction",
            "entropy",
            "steps_per_second",
            "forward_share",
            "zero_advantage_share",
            "advantage_abs",
            "tokens_per_second",
            *(("backbone_reward", "backbone_loss_ratio") if self.rollout is Rollout.BRANCH else ("paper_reward",)),
        )
        self.figures = torch.nn.ModuleDict({name: MeanMetric() for name in names})

    # -- the frozen model ----------------------------------------------------------------------------
    @property
    def frozen_model(self) -> torch.nn.Module:
        """The frozen LM on this module's device, loaded at first use (kept out of the module's children)."""
        if self._frozen is None:
            self._frozen = FrozenModel(self.hparams.model, device=str(self.device), dtype=self.model_dtype)
            model, _ = self._frozen.load()
            self.scorer.check_compatible(describe(model))
            model.requires_grad_(False).eval()
        return self._frozen.load()[0]

    # -- one step ------------------------------------------------------------------------------------
    def rollout_rows(self) -> range:
        """The rows of each group this rank replays (all of them on one process)."""
        world, rank = self.trainer.world_size, self.trainer.global_rank
        branches = self.rollout is Rollout.BRANCH
        size = self.branches.rows if branches else self.hparams.group_size
        if size % world:
            name = "branch_rows K" if branches else "group_size G"
            raise ValueError(f"{name}={size} must be a multiple of the number of processes ({world})")
        share = size // world
        return range(rank * share, (rank + 1) * share)

    def roll_out(self, traces: Sequence[Trace]) -> Iterator[GroupRollout]:
        """This rank's rollouts of a batch's traces (no grad), `traces_per_replay` groups per replay, the
        traces of similar length together (a row past its trace's end replays padding); one replay's
        groups at a time, so only their recorded evictions are held while they are used."""
        round_index = self.global_step // self.hparams.epochs
        reward = RewardSettings(
            self.hparams.low_entropy_share,
            self.hparams.damage_threshold,
            self.hparams.damage_exponent,
            self.estimator.damage_terms,
        )
        if self.rollout is Rollout.BRANCH:
            for trace in traces:
                yield from roll_out_branches(
                    self.frozen_model,
                    self.scorer,
                    trace,
                    self.branches,
                    self.rollout_rows(),
                    seed=self.hparams.seed,
                    round_index=round_index,
                    temperature=self.hparams.temperature,
                    reward=reward,
                    storage_dtype=self.storage_dtype,
                    reference_nll=self._reference_nll(trace),
                    labels=None
                    if self._golden is None
                    else self._golden.load(trace.index, num_tokens=trace.input_ids.numel()),
                )
            return
        scoring = dict(
            share=reward.share,
            threshold=reward.threshold,
            exponent=reward.exponent,
            terms=reward.terms,
            storage_dtype=self.storage_dtype,
            temperature=self.hparams.temperature,
        )
        for packed in packs(traces, self.hparams.traces_per_replay):
            seeds = [
                rollout_seeds(self.hparams.seed, round_index, trace.index, self.rollout_rows()) for trace in packed
            ]
            yield from roll_out_together(
                self.frozen_model,
                self.scorer,
                packed,
                seeds,
                reference_nll=[self._reference_nll(trace) for trace in packed],
                **scoring,
            )

    def on_fit_start(self) -> None:
        """The golden-swap rows' labels, every training trace's checked before the first rollout."""
        if not self.branches.golden_swaps:
            return
        data, config = self.trainer.datamodule, self.scorer.config
        store = LabelStore(data.traces_dir, config.budget, config.interval, LabelKind.ALPHA, config.regime)
        missing = [trace.index for trace in data.train if trace.index not in store]
        if missing:
            raise ValueError(
                f"branch_golden_swaps={self.branches.golden_swaps} needs golden labels for every training trace; "
                f"{len(missing)} of {len(data.train)} have none in {store.directory} (make them with `foresight labels "
                f"--traces {data.traces_dir} -B {config.budget} -L {config.interval} --regime {config.regime.value}`)"
            )
        self._golden = store

    def _reference_nll(self, trace: Trace) -> torch.Tensor | None:
        """The full-cache losses a trace's rollouts are scored against: None (its stored ones) or, with
        loss_reference "replay", the frozen model's own, replayed once and kept."""
        if self.loss_reference is LossReference.STORED:
            return None
        if trace.index not in self._full_cache_nll:
            self._full_cache_nll[trace.index] = full_cache_losses(self.frozen_model, trace)
        return self._full_cache_nll[trace.index]

    def training_step(self, batch: Sequence[Trace], batch_idx: int) -> None:
        """Roll out, score and back-propagate one replay's groups at a time (only their recorded evictions
        are held, unless epochs > 1 keeps them for the further updates), then step."""
        started = time.perf_counter()
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        beta, rows = self.current_beta(), self.rollout_rows()
        optimizer.zero_grad()
        updates, rewards, forward_seconds = [], [], 0.0
        for group, advantages in self._credited(self.roll_out(batch)):
            update = _Update(
                group.actions,
                advantages[rows.start : rows.stop],
                self.scorer,
                self.reference,
                self.estimator.action_logprob,
            )
            self._backward(update, beta, len(batch))
            self._tally(group)
            rewards.append(self._gather_group(group.scores.reward))
            forward_seconds += group.forward_seconds
            if self.hparams.epochs > 1:
                updates.append(update)
        self._step(optimizer, schedule)
        for _ in range(self.hparams.epochs - 1):
            optimizer.zero_grad()
            for update in updates:
                self._backward(update, beta, len(batch))
            self._step(optimizer, schedule)
        self.figures["forward_share"].update(forward_seconds / (time.perf_counter() - started))
        kl = float(self.figures["kl_per_set"].compute())  # of the policy that rolled out this step's batch
        self._log_step(torch.stack(rewards), beta)
        self._control_kl(kl)

    def _credited(self, groups: Iterable[GroupRollout]) -> Iterator[tuple[GroupRollout, torch.Tensor]]:
        """Each group with its advantages over every rank's rows, [rows] per rollout or [rows, steps] per
        eviction step (`credit`): as it is rolled out with a per-group rule; with a batch-wide one
        (self-critical) once the whole batch is, every group's recorded evictions held until then. Logs the
        share of groups whose advantages are all 0."""
        if self.estimator.batch_wide:
            groups = list(groups)
            rewards = torch.stack([self._gather_group(group.scores.credited(self.credit)) for group in groups])
            credited = zip(groups, self.estimator.batch_advantages(rewards), strict=True)
        else:
            credited = (
                (group, self.estimator.advantages(self._gather_group(group.scores.credited(self.credit)), dim=0))
                for group in groups
            )
        for group, advantages in credited:
            zero = (advantages == 0).all(0)
            self.figures["zero_advantage_share"].update(zero.float().mean(), weight=zero.numel())
            self.figures["advantage_abs"].update(advantages.abs().mean())
            yield group, advantages

    def _backward(self, update: _Update, beta: float, traces: int) -> None:
        """Back-propagate this trace's share (1 / traces) of minus Eq. 10, through the scorer only."""
        actions = update.actions
        with self._no_gradient_sync():
            scores = actions.scores(self.scorer)
            logprob = actions.logprob(scores, self.estimator.action_logprob)
            by_step = [lp.transpose(1, 2) for lp in (logprob, update.old_logprob, update.ref_logprob)]
            objective = grpo_objective(  # [rows, steps, layers, Hkv]: a row's or a step's advantage broadcasts
                *by_step,
                update.advantages.to(scores.device),
                beta,
                clip=self.hparams.clip,
                clamp=LOG_RATIO_CLAMP,
            )
            self.manual_backward(objective.loss / traces)
        self.figures["kl_per_set"].update(objective.kl)
        self.figures["kl_per_step"].update(objective.kl_terms.flatten(2).sum(-1).mean())  # each step's sets summed
        self.figures["clip_fraction"].update(objective.clip_fraction)
        self.figures["entropy"].update(actions.first_draw_entropy(scores.detach()).mean())

    def _step(self, optimizer, schedule) -> None:
        self._average_gradients()
        if self.hparams.max_grad_norm is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        schedule.step()

    def current_beta(self) -> float:
        """β at this optimisation step (0 after kl_steps, when set; adapted to the KL with kl_target)."""
        kl_steps = self.hparams.kl_steps
        return 0.0 if kl_steps is not None and self.global_step >= kl_steps else self.beta

    @property
    def beta_floor(self) -> float:
        """The lowest β the KL adaptation halves to."""
        floor = self.hparams.get("beta_floor")
        return self.hparams.beta if floor is None else floor

    def _control_kl(self, kl: float) -> None:
        """After a step whose rollouts' policy was `kl` nats per set from the start: adapt β (kl_target) and
        stop the run past kl_stop (`GRPOScorer`'s docstring)."""
        target, stop = self.hparams.kl_target, self.hparams.kl_stop
        if target is not None:
            if kl > 1.5 * target:
                self.beta *= 2
            elif kl < target / 1.5:
                self.beta = max(self.beta / 2, self.beta_floor)
        if stop is not None and kl > stop:
            self.trainer.should_stop = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["kl_beta"] = self.beta

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.beta = checkpoint.get("kl_beta", self.hparams.beta)

    def _gather_group(self, rewards: torch.Tensor) -> torch.Tensor:
        """[G / world, ...] rewards of this rank -> the group's [G, ...], in row order (all-gather across ranks)."""
        if self.trainer.world_size == 1:
            return rewards
        return self.all_gather(rewards.to(self.device)).flatten(0, 1).cpu()  # [world, G / world, ...] -> [G, ...]

    def _no_gradient_sync(self) -> contextlib.AbstractContextManager:
        """DDP's own all-reduce off: `_average_gradients` averages once after all backward passes."""
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return contextlib.nullcontext() if block is None else block()

    def _average_gradients(self) -> None:
        if self.trainer.world_size == 1 or not dist.is_initialized():
            return
        for parameter in self.trained_parameters():
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
            parameter.grad /= self.trainer.world_size

    def _tally(self, group: GroupRollout) -> None:
        """Add one trace's rollouts to the step's figures."""
        self.figures["loss_ratio"].update(group.scores.loss_ratio.mean())
        self.figures["damage"].update(group.scores.damage_share.mean())
        self.figures["steps_per_second"].update(group.eviction_steps / group.seconds)
        self.figures["tokens_per_second"].update(group.forward_tokens / group.seconds)
        if group.backbone is not None:
            self.figures["backbone_reward"].update(group.backbone.reward)
            self.figures["backbone_loss_ratio"].update(group.backbone.loss_ratio)
        if self.rollout is Rollout.EPISODE:
            self.figures["paper_reward"].update(group.scores.paper_reward.mean())

    def _log_step(self, rewards: torch.Tensor, beta: float) -> None:
        """Log the step's figures (rewards [traces, G], gathered from every rank) and reset them."""
        size = rewards.shape[0]
        self.figures["reward"].update(rewards.mean())
        for name, metric in self.figures.items():
            self.log(f"train/{name}", metric.compute(), prog_bar=name in ("reward", "kl_per_set"), batch_size=size)
            metric.reset()
        self.log("train/reward_std", rewards.std(-1, unbiased=False).mean(), batch_size=size)
        self.log("train/reward_rms", rewards.square().mean().sqrt(), batch_size=size)  # self-critical's scale
        self.log("train/beta", beta, batch_size=size)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=size)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.trained_parameters(), lr=self.hparams.lr)
        warm_up = self.hparams.warm_up
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warm_up) if warm_up else 1.0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def stage_settings(self) -> dict[str, str]:
        hparams = self.hparams
        settings = (
            f"G = {hparams.group_size}, lr {hparams.lr} after {hparams.warm_up} warm-up steps, β = {hparams.beta}"
            + (f" for {hparams.kl_steps} steps" if hparams.kl_steps is not None else "")
            + f", ε = {hparams.clip}, {hparams.epochs} update(s) per batch of rollouts, sampling temperature τ = "
            + f"{hparams.temperature}; reward ΔL^{hparams.damage_exponent}·1[ΔL > {hparams.damage_threshold}], "
            + f"credit: {self.credit.value}; {self.estimator.describe()}"
        )
        control = {"KL control": self.kl_control()}
        if self.rollout is Rollout.BRANCH:
            branches = self.branches
            layers = "every layer" if branches.layers is None else f"{branches.layers} layers per group"
            return {
                "GRPO": settings,
                **control,
                "rollouts": (
                    f"step-level branch groups: K = {branches.rows} rows at {branches.steps} eviction steps per trace, "
                    f"sampled on {layers}, continued deterministically "
                    + ("to the trace's end" if branches.chunks is None else f"for W = {branches.chunks} chunks")
                ),
            }
        return {
            "GRPO": settings,
            **control,
            "rollouts": f"episodes: G = {hparams.group_size} per trace, every step sampled",
        }

    def kl_control(self) -> str:
        """β's rule and the stopping rule, in words (for the card): both fixed before any evaluation."""
        hparams, trainer = self.hparams, self._trainer
        beta = (
            f"β adapted from {hparams.beta} to hold the KL per (layer, KV head) set near {hparams.kl_target} nats "
            f"(×2 above {1.5 * hparams.kl_target:g}, ÷2 below {hparams.kl_target / 1.5:g}, never below {self.beta_floor})"
            if hparams.kl_target is not None
            else f"β fixed at {hparams.beta}"
        )
        limits = [] if trainer is None else [f"{trainer.max_epochs} epochs", f"{trainer.max_steps} steps"]
        limits = [limit for limit in limits if not limit.startswith(("-1 ", "None "))]
        if hparams.kl_stop is not None:
            limits.append(f"the first step whose KL per set exceeds {hparams.kl_stop} nats")
        return f"{beta}; stops after {' or '.join(limits) if limits else 'no limit'}"


class _Update:
    """What one trace's update needs: its recorded evictions, the advantage of each of this rank's rows,
    and the log-probability of every eviction under the scorer that sampled it (π_old) and under π_ref."""

    def __init__(
        self,
        actions: EvictionActions,
        advantages: torch.Tensor,
        scorer: ForesightScorer,
        reference: ForesightScorer,
        rule: LogprobRule,
    ) -> None:
        self.actions, self.advantages = actions, advantages
        with torch.no_grad():
            self.old_logprob = actions.logprob(actions.scores(scorer), rule)
            self.ref_logprob = actions.logprob(actions.scores(reference), rule)
