"""The keyword under which a transformers model's forward takes its KV cache.

transformers named it `past_key_values` up to 5.2x and `cache` since, warning (FutureWarning) on the old
name until its removal in 5.40. Every call of this project that hands a model a cache passes it through
`cache_argument`, which reads the name from the forward's signature once per model class, so the same
code runs on each supported release (pyproject.toml) without a deprecation warning.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

CACHE_NAMES = ("cache", "past_key_values")
"""The names a forward may take its cache under, newest first."""


@functools.cache
def cache_name(model_class: type[nn.Module]) -> str:
    """The keyword of `model_class.forward`'s cache: the newest of `CACHE_NAMES` its signature has (a
    deprecated name stays accepted beside the new one for a few releases, so the newest wins)."""
    parameters = inspect.signature(model_class.forward).parameters
    for name in CACHE_NAMES:
        if name in parameters:
            return name
    raise ValueError(f"{model_class.__name__}.forward takes no cache (none of {', '.join(CACHE_NAMES)})")


def cache_argument(model: nn.Module, cache: object) -> dict[str, object]:
    """`{name: cache}` for `model(**inputs, **cache_argument(model, cache))`."""
    return {cache_name(type(model)): cache}


def passed_cache(kwargs: dict[str, object]) -> object | None:
    """The cache a forward was given, under whichever name (for a forward hook that reads it)."""
    return next((kwargs[name] for name in CACHE_NAMES if kwargs.get(name) is not None), None)
