"""ForesightKV: learned and heuristic KV-cache eviction for reasoning language models.

The public API, as kvpress exports its presses::

    from foresight import EvictionEngine, EvictionConfig, make_policy, load_scorer, load_model
    model, tokenizer = load_model("default")
    engine = EvictionEngine(model, make_policy("snapkv"), EvictionConfig(budget=128, interval=32))

Training lives in the `trainers` package (`trainers.fit`, `trainers.rl`, docs/training.md); `evaluate`
replays traces under policies as `foresight eval` does.

Names resolve on first use (PEP 562), so `import foresight` and the CLI's start stay light.
"""

from __future__ import annotations

from foresight.lazy_exports import lazy_exports

_EXPORTS = {
    "EvictionEngine": "foresight.runtime.engine",
    "EvictionConfig": "foresight.runtime.engine",
    "SamplingConfig": "foresight.runtime.sampling",
    "REASONING_SAMPLING": "foresight.runtime.sampling",
    "EvictionCache": "foresight.runtime.cache",
    "EvictionContext": "foresight.runtime.policy",
    "Policy": "foresight.runtime.policy",
    "POLICIES": "foresight.policies",
    "make_policy": "foresight.policies",
    "register": "foresight.policies",
    "ForesightScorer": "foresight.scorer.model",
    "ScorerConfig": "foresight.scorer.model",
    "load_scorer": "foresight.scorer.model",
    "load_model": "foresight.models",
    "compute_golden_labels": "foresight.labels",
    "TraceStore": "foresight.data.trace_store",
    "evaluate": "foresight.eval.replay",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("foresight", _EXPORTS)
