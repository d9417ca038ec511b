"""Training learned evictors: the data stage, the supervised and reinforcement stages, and export.

The front door, as the command line runs it (docs/training.md)::

    import trainers
    from trainers import TraceRecipe
    trainers.make_traces("runs/mine/traces", TraceRecipe("reasoning-gym:gsm_symbolic", num=64, max_new_tokens=768))
    trainers.make_labels("runs/mine/traces", budget=128, interval=32)
    scorer = trainers.fit("configs/default.yaml", "runs/mine", traces="runs/mine/traces")
    refined = trainers.rl("configs/default-rl.yaml", scorer, "runs/mine-rl", traces="runs/mine/traces")

Names resolve on first use (PEP 562), so importing a module of the package loads no trainer.
"""

from __future__ import annotations

from foresight.lazy_exports import lazy_exports

_EXPORTS = {
    "make_traces": "trainers.api",
    "make_labels": "trainers.api",
    "fit": "trainers.api",
    "rl": "trainers.api",
    "TraceRecipe": "trainers.data_stage",
    "FitRequest": "trainers.fitting",
    "RLRequest": "trainers.reinforcement.stage",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("trainers", _EXPORTS)
