"""Export a trained scorer as a Hugging Face Hub folder with a model card, and push it.

A folder holds config.json (the `ScorerConfig`), model.safetensors and README.md, a model card
naming the base model, B, L, the features, how the scorer was trained and how to load it. A
Lightning checkpoint of a training stage carries the scorer and what the card needs under two
entries the stage writes with `checkpoint_entries` (`SCORER_KEY`, `TRAINING_KEY`), so exporting
needs neither Lightning, nor the trainer's module layout, nor the training data. Checkpoints are read with `torch.load(weights_only=True)`: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token

from foresight.models import DEFAULT_MODEL
from foresight.scorer.attention_features import FEATURE_NAMES
from foresight.scorer.model import ForesightScorer, ScorerConfig, load_scorer

SCORER_KEY = "foresight_scorer"
"""Checkpoint entry: {"config": the `ScorerConfig` as plain values, "state_dict": the scorer's tensors}."""
TRAINING_KEY = "foresight_training"
"""Checkpoint entry: what the scorer was trained on and its latest metrics (plain values)."""
DEFAULT_BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub id of the embedded default model (`foresight.models`), for the card's metadata."""


def scorer_config_dict(config: ScorerConfig) -> dict[str, Any]:
    """A `ScorerConfig` as plain values (the config of `SCORER_KEY`)."""
    plain = {"feature_set": config.feature_set.value, "regime": config.regime.value, "scale": config.scale.value}
    return {**asdict(config), **plain}


def checkpoint_entries(scorer: ForesightScorer, training: dict[str, Any]) -> dict[str, Any]:
    """The entries a training stage adds to its Lightning checkpoint so that `read_checkpoint` can
    rebuild the scorer from the file alone."""
    state = {name: tensor.detach().cpu() for name, tensor in scorer.state_dict().items()}
    return {SCORER_KEY: {"config": scorer_config_dict(scorer.config), "state_dict": state}, TRAINING_KEY: training}


def read_checkpoint(path: str | os.PathLike) -> tuple[ForesightScorer, dict[str, Any]]:
    """The scorer and its training record from a supervised-stage Lightning checkpoint (.ckpt), or from
    a scorer folder or Hub id (whose record is empty)."""
    path = Path(path)
    if not path.suffix == ".ckpt" and not path.is_file():
        return load_scorer(path), {}
    if not path.is_file():
        raise ValueError(f"no checkpoint at {path}: expected a Lightning .ckpt file, a scorer folder or a Hub id")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several unrelated types for a file that is not a checkpoint
        raise ValueError(f"{path} is not a readable checkpoint ({type(error).__name__})") from None
    if SCORER_KEY not in checkpoint:
        raise ValueError(f"{path} is not a checkpoint of a scorer training stage (no {SCORER_KEY!r} entry)")
    scorer = ForesightScorer(ScorerConfig(**checkpoint[SCORER_KEY]["config"]))
    scorer.load_state_dict(checkpoint[SCORER_KEY]["state_dict"], strict=True)
    return scorer.eval(), checkpoint.get(TRAINING_KEY, {})


def ensemble_record(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The training record of a seed ensemble (`foresight.scorer.ensemble`) for its model card: what it
    averages, the entries every member's record shares, and each metric's mean over the members."""
    shared = {
        key: value
        for key, value in records[0].items()
        if key != "metrics" and all(record.get(key) == value for record in records)
    }
    metrics = [record.get("metrics") or {} for record in records]
    names = [name for name in metrics[0] if all(name in member for member in metrics)]
    mean = {name: round(sum(member[name] for member in metrics) / len(metrics), 6) for name in names}
    what = f"the mean keep score of {len(records)} fits of one recipe under successive seeds; metrics: their means"
    return {"ensemble": what, **shared, **({"metrics": mean} if mean else {})}


def export_scorer(
    scorer: ForesightScorer,
    out_dir: str | os.PathLike,
    training: dict[str, Any] | None = None,
    evaluation: str | None = None,
) -> Path:
    """Write config.json, model.safetensors and README.md (the model card) to `out_dir`."""
    out_dir = Path(out_dir)
    scorer.save_pretrained(out_dir)
    model_card(scorer.config, training or {}, evaluation).save(out_dir / "README.md")
    return out_dir


def push_folder(folder: str | os.PathLike, repo_id: str, private: bool = False) -> str:
    """Upload an exported folder to the Hub repo `repo_id` (created if missing); returns its URL.

    Failures (no token, no network, a refused repo) become one-line ValueErrors; the folder is left
    as it was, complete, to push later."""
    retry = f"the folder {folder} is complete; push it later with `hf upload {repo_id} {folder}`"
    if get_token() is None:
        raise ValueError(
            f"cannot push to {repo_id}: no Hugging Face token (run `hf auth login` or set HF_TOKEN); {retry}"
        )
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="Upload ForesightKV scorer")
    except Exception as error:  # network and Hub errors come in many types (httpx, HfHubHTTPError, offline mode)
        reason = " ".join(str(error).split()[:20]) or type(error).__name__
        raise ValueError(f"cannot push to {repo_id}: {reason}; {retry}") from None
    return str(url)


def model_card(config: ScorerConfig, training: dict[str, Any], evaluation: str | None) -> ModelCard:
    """The README of an exported scorer."""
    base = DEFAULT_BASE_MODEL_ID if config.base_model == DEFAULT_MODEL else config.base_model
    on_hub = not Path(base).exists()
    data = ModelCardData(
        library_name="foresightkv",
        license="apache-2.0",
        tags=["kv-cache", "kv-cache-eviction", "foresightkv"],
        base_model=base if on_hub else None,
    )
    features = ", ".join(FEATURE_NAMES[config.feature_set])
    heads = "per query head" if config.feature_set.per_query_head else "per KV head"
    sections = [
        f"# ForesightKV scorer for {base}",
        "Learned KV-cache eviction scores (ForesightKV, §3.1): one MLP per (layer, KV head), "
        f"x = [{'key || value || ' if config.key_values else ''}attention features] -> Linear({config.input_dim}, {config.hidden}) -> GELU -> "
        "Linear(1), a keep score per cache entry.",
        "| setting | value |\n|---|---|\n"
        f"| base model | `{config.base_model}` ({config.num_layers} layers, {config.num_query_heads} query heads, "
        f"{config.num_kv_heads} KV heads, head dim {config.head_dim}) |\n"
        f"| budget B | {config.budget} |\n| interval L | {config.interval} |\n"
        f"| eviction regime | {config.regime.value} (docs/algorithms.md §1) |\n"
        f"| score scale | {config.scale.value} |\n"
        f"| features | `{config.feature_set.value}`: {features} ({heads}, {config.feature_set.transform}) |\n"
        f"| hidden width H | {config.hidden} |\n"
        f"| training stage | {config.stage}{_started_from(config)} |"
        + (
            f"\n| training sources | {', '.join(f'`{s}`' for s in config.training_sources)} |"
            if config.training_sources
            else ""
        ),
        "## Training\n" + _training_text(config, training),
    ]
    if evaluation:
        sections.append("## Evaluation\n" + evaluation.strip())
    sections.append(
        "## Use\n```python\nfrom foresight.models import load_model\nfrom foresight.policies import make_policy\n"
        "from foresight.runtime.engine import EvictionConfig, EvictionEngine\n\n"
        f"model, tokenizer = load_model({json.dumps(config.base_model)})\n"  # double quotes, as the formatter writes
        'policy = make_policy("foresight", scorer="PATH_OR_REPO_ID")\n'
        f"engine = EvictionEngine(model, policy, EvictionConfig(budget={config.budget}, interval={config.interval}))\n"
        "```\n"
        "The scorer refuses a model of another shape and a cache with another B or L."
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


STAGE_TEXT = {
    "supervised": "Supervised stage (ForesightKV §3.2): pairwise ranking loss (Eq. 6) against Golden Eviction future scores.",
    "reinforcement": "Reinforcement stage (ForesightKV §3.3): GRPO (Eq. 9-10) with the low-entropy loss reward (Eq. 8), "
    "starting from a supervised scorer that is also the KL reference.",
}
METRIC_NOTES = {
    "supervised": "loss: Eq. 6; overlap: share of the golden kept set (top B - L by α) that the scorer keeps; "
    "overlap_cumulative: the same for ranking by cumulative attention (H2O's statistic); spearman: rank "
    "correlation of the scores with α. val/: held-out traces.",
    "reinforcement": "reward: R of Eq. 8 as docs/algorithms.md §7 defines it (minus the mean over the low-entropy tokens "
    "of ΔL^p·1[ΔL > η], p and η as in the GRPO settings); loss_ratio and damage: the rollouts' loss ratio and share of "
    "damaged low-entropy tokens; kl: k3 estimate of KL(π_θ ‖ π_ref) per eviction; clip_fraction: share of evictions "
    "whose ratio was clipped; zero_advantage_share: share of reward groups whose rewards were all equal (advantage 0).",
}


def _started_from(config: ScorerConfig) -> str:
    return f", started from `{config.started_from}`" if config.started_from else ""


def _training_text(config: ScorerConfig, training: dict[str, Any]) -> str:
    stage = STAGE_TEXT[config.stage] + (f" Started from `{config.started_from}`." if config.started_from else "")
    if not training:
        return stage + "\n\nNo training record was exported with this scorer."
    lines = [f"- {key.replace('_', ' ')}: {_plain(value)}" for key, value in training.items() if key != "metrics"]
    metrics = reported_metrics(training)
    if metrics:
        lines.append(
            "\n| metric | value |\n|---|---|\n"
            + "\n".join(f"| {name} | {_plain(value)} |" for name, value in metrics.items())
            + "\n\n"
            + METRIC_NOTES[config.stage]
        )
    return stage + "\n\n" + "\n".join(lines)


def reported_metrics(training: dict[str, Any]) -> dict[str, float]:
    """The metrics of a training record worth reporting: all but the learning rate."""
    return {name: value for name, value in (training.get("metrics") or {}).items() if not name.endswith("/lr")}


def _plain(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
