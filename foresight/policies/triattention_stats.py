"""TriAttention's offline query statistics: computed from traces, stored, loaded and checked.

Per (layer, query head) and RoPE band f (the pair (x_f, x_{f + D/2}) that RoPE rotates by ω_f · position,
as a complex number): the mean pre-RoPE query E[q_f] and mean modulus E|q_f|, as the authors'
`scripts/calibrate.py` computes them. The post-RoPE queries are captured where attention runs
(through `foresight.runtime.capture.register_attention`, as the labels do) and rotated back with the model's own rotary cos/sin, as the
authors do: this works for every architecture, where a hook on q_proj would miss Qwen3's q_norm.
A folder holds config.json (model, shape, rotary scale, tokens, source) and model.safetensors (q_mean_real,
q_mean_imag, q_abs_mean [layers, Hq, D/2], inv_freq [D/2]) whose metadata repeats the identity, so a
torn rewrite is caught on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from foresight.artifacts import check_metadata, read_tensors, save_tensors, write_text
from foresight.models import ModelShape, describe
from foresight.runtime.capture import attention_implementation, full_cache_forward, register_attention

FORMAT = "foresight-triattention-stats/1"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
REMAKE = "`foresight calibrate --traces TRACES --out DIR`"
CAPTURE_ATTENTION = "foresight_triattention_capture"


@dataclass
class TriAttentionStats:
    """The statistics of one model: q_mean (complex) and q_abs_mean [layers, Hq, D/2], inv_freq [D/2]
    (ω_f), rope_scale (the rotary's attention scaling s: cos and sin carry a factor s)."""

    model: str
    shape: ModelShape
    q_mean: torch.Tensor
    q_abs_mean: torch.Tensor
    inv_freq: torch.Tensor
    rope_scale: float = 1.0
    tokens: int = 0
    source: str = ""

    def check_fits(self, num_layers: int, num_kv_heads: int, head_dim: int, num_query_heads: int | None = None) -> None:
        """One-line ValueError naming both shapes when the cache is not of the model the stats were made for."""
        mine = self.shape
        query_heads = mine.num_query_heads if num_query_heads is None else num_query_heads
        if (num_layers, query_heads, num_kv_heads, head_dim) != tuple(vars(mine).values()):
            theirs = f"{num_layers} layers x {query_heads} query / {num_kv_heads} KV heads x {head_dim} dims"
            raise ValueError(
                f"TriAttention stats made for {self.model!r} ({mine}) do not fit this model ({theirs}); "
                f"make stats for it with {REMAKE} on its own traces"
            )

    def check_model(self, model: PreTrainedModel) -> None:
        """As `check_fits`, for a loaded model; also refuses other RoPE frequencies (another rope_theta)."""
        shape = describe(model)
        self.check_fits(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.num_query_heads)
        inv_freq = model.base_model.rotary_emb.inv_freq.float().cpu()
        if inv_freq.shape != self.inv_freq.shape or not torch.allclose(inv_freq, self.inv_freq, rtol=1e-5):
            raise ValueError(f"TriAttention stats made for {self.model!r} use other RoPE frequencies than this model")

    def to(self, device: torch.device | str) -> TriAttentionStats:
        """The same stats with their tensors on `device` (moved once, not at every eviction step)."""
        return replace(
            self,
            q_mean=self.q_mean.to(device),
            q_abs_mean=self.q_abs_mean.to(device),
            inv_freq=self.inv_freq.to(device),
        )

    def identity(self) -> dict[str, str]:
        """What the safetensors metadata repeats of config.json."""
        return {"format": FORMAT, "model": self.model, "shape": str(self.shape), "tokens": str(self.tokens)}

    def save(self, folder: str | os.PathLike) -> Path:
        """Write (or replace) config.json and model.safetensors in `folder`, each file atomically."""
        folder = Path(folder)
        tensors = {
            "q_mean_real": self.q_mean.real,
            "q_mean_imag": self.q_mean.imag,
            "q_abs_mean": self.q_abs_mean,
            "inv_freq": self.inv_freq,
        }
        save_tensors(folder / WEIGHTS, {k: v.float().contiguous() for k, v in tensors.items()}, self.identity())
        config = {
            "format": FORMAT,
            "model": self.model,
            **vars(self.shape),
            "rope_scale": self.rope_scale,
            "tokens": self.tokens,
            "source": self.source,
        }
        write_text(folder / CONFIG, json.dumps(config, indent=2) + "\n")
        return folder


def load_stats(folder: str | os.PathLike) -> TriAttentionStats:
    """The stats in a folder written by `foresight calibrate`; one-line errors when missing or mismatched."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise ValueError(f"{folder} is not a TriAttention stats folder (no {CONFIG}); make one with {REMAKE}")
    config = json.loads((folder / CONFIG).read_text())
    if config.get("format") != FORMAT:
        raise ValueError(
            f"{folder / CONFIG} is not {FORMAT} (format {config.get('format')!r}); make it again with {REMAKE}"
        )
    shape = ModelShape(**{name: config[name] for name in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim")})
    metadata, tensors = read_tensors(folder / WEIGHTS, REMAKE)
    stats = TriAttentionStats(
        config["model"],
        shape,
        torch.complex(tensors["q_mean_real"], tensors["q_mean_imag"]),
        tensors["q_abs_mean"],
        tensors["inv_freq"],
        config["rope_scale"],
        config["tokens"],
        config.get("source", ""),
    )
    check_metadata(folder / WEIGHTS, metadata, stats.identity(), REMAKE)
    return stats


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class QueryMoments:
    """Running sums of the pre-RoPE queries of every layer, fed by the capture attention function."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.shape = describe(model)
        self.rotary = model.base_model.rotary_emb
        self.scale = float(getattr(self.rotary, "attention_scaling", 1.0))
        if self.rotary.inv_freq.numel() * 2 != self.shape.head_dim:
            raise ValueError(
                f"TriAttention needs RoPE over the whole head dim ({self.shape.head_dim}); this model rotates "
                f"{self.rotary.inv_freq.numel() * 2} dims"
            )
        bands = (self.shape.num_layers, self.shape.num_query_heads, self.shape.head_dim // 2)
        self.sums = {name: torch.zeros(bands, dtype=torch.float64) for name in ("real", "imag", "abs")}
        self.tokens = 0

    def add(self, layer: int, query: torch.Tensor, end: int) -> None:
        """Add the queries [1, Hq, q, D] of positions end - q .. end - 1 (post-RoPE, as attention gets them)."""
        post = query[0].float()
        positions = torch.arange(end - post.shape[1], end, device=post.device)[None]
        cos, sin = self.rotary(post, positions)  # [1, q, D], both carrying the factor s
        pre = (post * cos - rotate_half(post) * sin) / self.scale**2  # R(-θ) post / s: the authors' invert_rope
        real, imag = pre.chunk(2, dim=-1)
        for name, part in (("real", real), ("imag", imag), ("abs", torch.hypot(real, imag))):
            self.sums[name][layer] += part.sum(dim=1).double().cpu()
        if layer == 0:
            self.tokens += post.shape[1]

    def stats(self, model: str, source: str) -> TriAttentionStats:
        if self.tokens == 0:
            raise ValueError("no tokens to calibrate TriAttention on")
        mean = {name: (total / self.tokens).float() for name, total in self.sums.items()}
        return TriAttentionStats(
            model,
            self.shape,
            torch.complex(mean["real"], mean["imag"]),
            mean["abs"],
            self.rotary.inv_freq.float().cpu(),
            self.scale,
            self.tokens,
            source,
        )


def _capture_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    *,
    triattention_moments: QueryMoments,
    **kwargs,
):
    """Attention function for AttentionInterface: add the queries to the moments, compute the output with SDPA."""
    triattention_moments.add(module.layer_idx, query, key.shape[-2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


register_attention(CAPTURE_ATTENTION, _capture_attention, full_cache=True)


@torch.no_grad()
def calibrate(
    model: PreTrainedModel,
    sequences: Iterable[torch.Tensor],
    *,
    model_name: str | None = None,
    source: str = "",
    chunk_size: int = 256,
) -> TriAttentionStats:
    """TriAttention stats of `model` over token sequences (1-D ids), each teacher-forced with the full
    cache in chunks of `chunk_size` tokens (which only bounds working memory)."""
    moments = QueryMoments(model)
    with attention_implementation(model, CAPTURE_ATTENTION):
        for ids in sequences:
            full_cache_forward(model, ids, chunk_size, triattention_moments=moments)
    return moments.stats(model.config.name_or_path if model_name is None else model_name, source)
