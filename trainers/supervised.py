"""The supervised stage as a LightningModule: the stacked scorer trained with the pairwise ranking loss
(ForesightKV §3.2 Eq. 6, App. E.1; docs/algorithms.md §6).

A batch holds the eviction steps of a few traces (`trainers.data`): keys, values [steps, layers, Hkv, B, D],
features [steps, layers, Hkv, B, F*G], alpha [steps, layers, Hkv, B], in their storage dtype: the
scorer casts its inputs on the device in the copy that lays them out for its matmuls. Every (step, layer, KV head)
is one ranking problem; the loss is Eq. 6's per-problem mean over pairs with α_i < α_j, averaged over
all problems of the global batch (a problem without a pair, all α equal, adds 0). Under DDP each rank
divides its sum by the problem count of all ranks, so the averaged gradient is exactly that of the
whole batch on one process, whatever the number of steps each rank's traces bring.

Only the scorer has parameters: the frozen model runs only to make the data, without grad.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torchmetrics import MeanMetric

from foresight.scorer.attention_features import cumulative_feature, feature_dim
from foresight.scorer.model import ForesightScorer, ScorerConfig, ScoreScale, load_scorer
from trainers.ranking import (
    DEFAULT_MARGIN,
    PAIR_BLOCK_ELEMENTS,
    PairWeight,
    ProblemWeight,
    RankingPairs,
    calibration_loss,
    kept_overlap,
    pairwise_ranking_loss,
    pooled_overlap,
    regret_weights,
    spearman,
)
from trainers.scorer_module import ScorerModule


class SupervisedScorer(ScorerModule):
    """Trains a `ForesightScorer` to rank candidates like their future scores.

    scorer: the `ScorerConfig` fields fixed by the data (model shape, B, L, features, base model);
      LightningCLI links them from the data module.
    hidden: H, the MLP width (16). key_values: whether the scorer reads each entry's key and value
      besides its attention features (the paper's x_n; false: features only). margin: m of Eq. 6 (0.01). lr, weight_decay: AdamW, the learning
      rate annealed by a cosine from `lr` to 0 over the run's optimisation steps (paper: lr 1e-2).
    pairs: "all" (Eq. 6, every pair) or "evicted" (only pairs whose lower member is one of the L
      entries the golden step evicts; `RankingPairs`).
    pair_weight: "uniform" (Eq. 6) or "gap" (each pair in proportion to α_j − α_i; `PairWeight`).
    problem_weight: "equal" (Eq. 6: every (step, layer, head) problem alike) or "regret" (each in proportion to
      what the scorer's current eviction of it costs against golden's, `ProblemWeight`).
    pair_chunk: rows of the pair matrix built at once (memory only; the loss uses every chosen pair).
    pair_block: pair-matrix numbers built at once over problems and rows (speed only: a block that stays in
      cache; null builds every problem of the batch at once, the layout before blocks).
    init_scorer: a scorer folder to start from instead of a fresh initialisation (an on-policy round
      refits from the previous round's scorer); its config must match this one's.
    calibration: weight λ of an auxiliary loss, the squared error of each score against log(α + ε), added to
      the ranking loss (0: none, the paper's). With λ > 0 the output bias b2 trains too and the scorer's
      scale is "log-target": its scores compare across heads and layers (`ScoreScale`), which a budget spent
      across heads needs; `val/pooled_overlap` measures it (the kept set of one budget per layer).
    residual: a feature the scorer adds to its MLP's output and starts from (`ScorerConfig.residual`; "last_1",
      TOVA's statistic, with the standardised-heuristic set): the fit trains a correction to that heuristic.
    teacher: a scorer folder to distil (the shipped ensemble into one member): the ranking loss orders each
      problem's candidates by the teacher's keep scores on the same inputs instead of by α, and
      `val/teacher_overlap` is the share of the teacher's kept set the student keeps (α still scores
      `val/overlap`); with pair_weight gap the pairs are weighted by the gaps of the teacher's scores. The teacher must
      read what the student reads (model shape, B, L, features).
    """

    def __init__(
        self,
        scorer: dict,
        hidden: int = 16,
        key_values: bool = True,
        margin: float = DEFAULT_MARGIN,
        lr: float = 1e-2,
        weight_decay: float = 0.0,
        pairs: str = RankingPairs.ALL.value,
        pair_weight: str = PairWeight.UNIFORM.value,
        problem_weight: str = ProblemWeight.EQUAL.value,
        pair_chunk: int = 256,
        pair_block: int | None = PAIR_BLOCK_ELEMENTS,
        init_scorer: str | None = None,
        calibration: float = 0.0,
        residual: str | None = None,
        teacher: str | None = None,
    ) -> None:
        super().__init__()
        pairs, pair_weight = RankingPairs.parse(pairs).value, PairWeight.parse(pair_weight).value
        problem_weight = ProblemWeight.parse(problem_weight).value
        for name, value in (("pair_chunk", pair_chunk), ("pair_block", pair_block)):
            if value is not None and value < 1:
                raise ValueError(
                    f"{name} must be a positive number of pairs{' or null' if name == 'pair_block' else ''}, got {value}"
                )
        if lr <= 0 or margin < 0 or weight_decay < 0 or calibration < 0:
            raise ValueError(
                f"need lr > 0, margin >= 0, weight_decay >= 0 and calibration >= 0, got lr={lr}, margin={margin}, "
                f"weight_decay={weight_decay}, calibration={calibration}"
            )
        if teacher is not None and calibration:
            raise ValueError(
                f"calibration={calibration} regresses on log α, while a distilled fit (teacher={teacher}) ranks by the "
                "teacher's scores: give one of them"
            )
        self.save_hyperparameters()
        scale = ScoreScale.LOG_TARGET if calibration else ScoreScale.ORDINAL
        config = ScorerConfig(**scorer, hidden=hidden, key_values=key_values, scale=scale, residual=residual)
        self.scorer = ForesightScorer(config)
        if init_scorer is not None:
            self.scorer.load_state_dict(_matching_weights(load_scorer(init_scorer), self.scorer.config, init_scorer))
        if not calibration:  # the calibration's target moves every score of a head: b2 trains then
            self.freeze_untrained()
        # A tuple, so the teacher is no submodule: never trained, saved or exported with the student.
        self._teacher = () if teacher is None else (_teacher(teacher, self.scorer.config),)
        # Means over every ranking problem of the validation set, synced across ranks; a problem whose
        # Spearman correlation is undefined (NaN: all α equal) is left out.
        self.val_overlap = MeanMetric(nan_strategy="ignore")
        self.val_spearman = MeanMetric(nan_strategy="ignore")
        self.val_overlap_cumulative = MeanMetric(nan_strategy="ignore")
        self.val_pooled_overlap = MeanMetric(nan_strategy="ignore")
        self.val_teacher_overlap = MeanMetric(nan_strategy="ignore")
        feature_set = self.scorer.config.feature_set
        self._cumulative, self._features_per_head = cumulative_feature(feature_set), feature_dim(feature_set)

    def stage_settings(self) -> dict[str, str]:
        """The ranking loss in words, for the model card."""
        hparams = self.hparams
        pairs = "every pair" if hparams.pairs == RankingPairs.ALL.value else "the pairs of a golden-evicted entry"
        weight = "each weighted by α_j − α_i" if hparams.pair_weight == PairWeight.GAP.value else "each alike (Eq. 6)"
        if hparams.get("problem_weight", ProblemWeight.EQUAL.value) == ProblemWeight.REGRET.value:
            weight += "; each problem weighted by the regret of the scorer's eviction against golden's"
        calibrated = (
            f", plus {hparams.calibration} × the squared error against log(α + ε)" if hparams.calibration else ""
        )
        distilled = f"; α is the keep score of the teacher {hparams.teacher}" if hparams.teacher else ""
        return {
            "ranking loss": f"hinge with margin {hparams.margin} over {pairs} with α_i < α_j, {weight}{calibrated}"
            + distilled,
            "optimiser": f"AdamW, lr {hparams.lr} annealed by a cosine to 0, weight decay {hparams.weight_decay}",
        }

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Keep scores [steps, layers, Hkv, B] of every candidate of every step of the batch."""
        inputs = [batch[name].transpose(0, 1) for name in ("keys", "values", "features")]  # layers first
        return self.scorer(*inputs).transpose(0, 1)

    def _loss(self, scores: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global-batch mean of Eq. 6 (see the module docstring)."""
        lowest = self.scorer.config.interval if self.hparams.pairs == RankingPairs.EVICTED.value else None
        per_problem, _ = pairwise_ranking_loss(
            scores,
            alpha,
            self.hparams.margin,
            self.hparams.pair_chunk,
            lowest,
            PairWeight.parse(self.hparams.pair_weight),
            self.hparams.pair_block,
        )
        if self.hparams.problem_weight == ProblemWeight.REGRET.value:
            per_problem = per_problem * regret_weights(scores, alpha, self.scorer.config.interval)
        if self.hparams.calibration:
            per_problem = per_problem + self.hparams.calibration * calibration_loss(scores, alpha)
        count = torch.tensor(float(per_problem.numel()), device=per_problem.device)
        world = self.trainer.world_size
        total = self.trainer.strategy.reduce(count, reduce_op="sum") if world > 1 else count
        return per_problem.sum() * world / total

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the ranking loss orders the candidates by: α, or the teacher's keep scores on the same inputs."""
        if not self._teacher:
            return batch["alpha"].float()
        (teacher,) = self._teacher
        inputs = [batch[name].transpose(0, 1) for name in ("keys", "values", "features")]
        with torch.no_grad():
            return teacher.to(self.device)(*inputs).transpose(0, 1).float()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(self(batch), self.targets(batch))
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["alpha"].shape[0])
        return loss

    def on_validation_epoch_start(self) -> None:
        """Fresh metric states made in this loop's grad mode: a standalone `validate` runs under
        inference mode, and the states it leaves cannot be updated in place by `fit`'s validation."""
        for metric in (
            self.val_overlap,
            self.val_spearman,
            self.val_overlap_cumulative,
            self.val_pooled_overlap,
            self.val_teacher_overlap,
        ):
            metric.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        scores, alpha = self(batch), batch["alpha"].float()
        size = alpha.shape[0]
        targets = self.targets(batch)
        self.log("val/loss", self._loss(scores, targets), prog_bar=True, sync_dist=True, batch_size=size)
        keep = self.scorer.config.budget - self.scorer.config.interval
        if self._teacher:
            self.val_teacher_overlap.update(kept_overlap(scores, targets, keep))
            self.log("val/teacher_overlap", self.val_teacher_overlap, prog_bar=True, batch_size=size)
        self.val_overlap.update(kept_overlap(scores, alpha, keep))
        self.val_spearman.update(spearman(scores, alpha))
        self.val_overlap_cumulative.update(kept_overlap(self.cumulative_attention(batch), alpha, keep))
        self.val_pooled_overlap.update(pooled_overlap(scores, alpha, keep))
        self.log("val/overlap", self.val_overlap, prog_bar=True, batch_size=size)
        self.log("val/pooled_overlap", self.val_pooled_overlap, batch_size=size)
        self.log("val/spearman", self.val_spearman, batch_size=size)
        self.log("val/overlap_cumulative", self.val_overlap_cumulative, batch_size=size)

    def cumulative_attention(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A heuristic to compare with: the cumulative-attention feature averaged over the G query heads
        (H2O's statistic, under log1p; the standardised set's standardised per-query cumulative rate), as
        keep scores [steps, layers, Hkv, B]."""
        features = batch["features"][..., self._cumulative :: self._features_per_head]
        return features.float().mean(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(
            self.trained_parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        # The name is the tag under which the CLI's LearningRateMonitor logs the learning rate.
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step", "name": "train/lr"}}


def _teacher(source: str, config: ScorerConfig) -> ForesightScorer:
    """The teacher scorer, frozen, refused in one line when it reads other inputs than the student."""
    teacher = load_scorer(source).eval().requires_grad_(False)
    shared = ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "budget", "interval", "feature_set")
    differing = [
        f"{name} {getattr(teacher.config, name)!r} (this run: {getattr(config, name)!r})"
        for name in shared
        if getattr(teacher.config, name) != getattr(config, name)
    ]
    if differing:
        raise ValueError(f"teacher {source} reads other inputs: {', '.join(differing)}")
    return teacher


def _matching_weights(start: ForesightScorer, config: ScorerConfig, source: str) -> dict[str, torch.Tensor]:
    """The weights of the starting scorer, refused when its architecture or inputs differ from `config`."""
    informative = {"base_model", "stage", "started_from", "training_sources", "regime", "scale"}
    differing = [
        f"{name} {value!r} (this run: {getattr(config, name)!r})"
        for name, value in asdict(start.config).items()
        if name not in informative and value != getattr(config, name)
    ]
    if differing:
        raise ValueError(f"init_scorer {source} was made with {', '.join(differing)}")
    return start.state_dict()
