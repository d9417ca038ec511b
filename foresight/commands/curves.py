"""Draw a training run's logged figures (its TensorBoard scalars) against the optimisation step as one PNG.

Reads every TensorBoard event file under RUN (a `foresight fit` or `foresight rl` folder; a run resumed
with --ckpt-path last writes a new file, and where two files log the same step the later one counts),
and draws one panel per tag: each logged value and its rolling mean over --window steps. The default
tags are the reinforcement stage's (reward, KL to the reference, first-draw entropy, share of groups
with zero advantage, clip fraction). The drawn series are written beside the PNG (OUT with .json), so a
figure outlives its run folder: RUN may be such a file, and `scripts/draw_results.py` redraws every
docs/figures/*-curves.json.

    foresight curves runs/rl-default --out docs/figures/rl-curves.png
    foresight curves runs/fit-default --tags train/loss,val/overlap --out runs/fit-default/curves.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

RL_TAGS = ("train/reward", "train/kl_per_set", "train/entropy", "train/zero_advantage_share", "train/clip_fraction")
EVENTS = "events.out.tfevents.*"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "folder",
        type=Path,
        metavar="RUN",
        help="a run folder (`foresight fit` or `foresight rl` --out), or the .json series an earlier drawing wrote",
    )
    parser.add_argument("--tags", default=",".join(RL_TAGS), help="comma-separated logged scalars to draw")
    parser.add_argument("--window", type=int, default=10, help="steps of the rolling mean drawn over the values")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")


def read_scalars(run: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag logged under `run`: {tag: {step: value}}, event files read oldest first; or the series
    a drawing wrote, when `run` is its .json file."""
    if run.suffix == ".json" and run.is_file():
        series = json.loads(run.read_text())["tags"]
        return {tag: {int(step): float(value) for step, value in points} for tag, points in series.items()}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(run.rglob(EVENTS), key=lambda path: path.stat().st_mtime)
    if not files:
        raise ValueError(
            f"{run} holds no TensorBoard logs ({EVENTS} under it); give the --out folder of a training run"
        )
    scalars: dict[str, dict[int, float]] = {}
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update((event.step, event.value) for event in accumulator.Scalars(tag))
    return scalars


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """The mean of each value and the up to `window` - 1 before it."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    starts = np.maximum(np.arange(1, len(values) + 1) - window, 0)
    return (sums[1:] - sums[starts]) / (np.arange(1, len(values) + 1) - starts)


def run(args: argparse.Namespace) -> int:
    if args.window < 1:
        raise ValueError(f"--window must be at least 1 step, got {args.window}")
    tags = [tag.strip() for tag in args.tags.split(",") if tag.strip()]
    scalars = read_scalars(args.folder)
    missing = [tag for tag in tags if tag not in scalars]
    if not tags or missing:
        raise ValueError(
            f"{args.folder} logged no {', '.join(missing) or 'tag'}; it logged {', '.join(sorted(scalars))}"
        )
    draw_curves(scalars, tags, args.window, str(args.folder), args.out)
    series = args.out.with_suffix(".json")
    if series.resolve() != args.folder.resolve():
        points = {tag: sorted(scalars[tag].items()) for tag in tags}
        series.write_text(json.dumps({"run": str(args.folder), "window": args.window, "tags": points}) + "\n")
    print(f"{args.out}: {', '.join(tags)} over {len(scalars[tags[0]])} steps of {args.folder} (series: {series})")
    return 0


def draw_curves(scalars: dict[str, dict[int, float]], tags: Sequence[str], window: int, title: str, out: Path) -> None:
    """One panel per tag: each value against its step and the rolling mean over `window` steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(len(tags), 1, figsize=(7, 2.2 * len(tags)), sharex=True, squeeze=False)
    for axis, tag in zip(axes[:, 0], tags):
        steps = np.array(sorted(scalars[tag]))
        values = np.array([scalars[tag][step] for step in steps])
        axis.plot(steps, values, ".", markersize=3, alpha=0.4, label="logged")
        axis.plot(steps, rolling_mean(values, window), "-", label=f"mean of {window}")
        axis.set_ylabel(tag.split("/")[-1])
        axis.grid(alpha=0.3)
    axes[0, 0].legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("optimisation step")
    figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
