"""The learned scorer: one small MLP per (layer, KV head), stacked (ForesightKV §3.1 Eq. 1, App. B.1 Eq. 22).

phi_n = W2 GELU(W1 x_n + b1) + b2 with x_n = [k_n || v_n || a_n] (key, value, attention features of
`foresight.scorer.attention_features`), W1: (2D + F*G) x H, W2: H x 1, H = 16. phi_n is a KEEP score (higher = keep).
All layers' and heads' MLPs live in four stacked parameters and run as batched matmuls:
    w1 [layers, Hkv, 2D + F*G, H]   b1 [layers, Hkv, H]   w2 [layers, Hkv, H]   b2 [layers, Hkv]
Init: each (layer, head) slice is initialised like its own `nn.Linear` (uniform in +-1/sqrt(fan_in)
for weights and biases), so the stack starts distributed exactly like the paper's independent MLPs.

Save/load goes through huggingface_hub's PyTorchModelHubMixin: `save_pretrained(dir)` writes
config.json (the `ScorerConfig`: base model shape, feature set, B, L) and model.safetensors;
`from_pretrained(dir_or_repo)` reads safetensors only, strictly (every tensor must match). (No
`from __future__ import annotations` here: the mixin reads the `config: ScorerConfig` annotation at
runtime to rebuild the dataclass.)

Its eviction rules (lowest scores, Eq. 2 sampling, Plackett-Luce) are in
`foresight.scorer.eviction_sampling`.

Size: one model end to end, its config (shape, inputs, x_n's width), the stacked MLP and its Hub save and
load; the config and the MLP read the same widths, so splitting them would split one definition of x_n.
"""

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Protocol

import safetensors.torch
import torch
from huggingface_hub import PyTorchModelHubMixin, constants, hf_hub_download
from huggingface_hub.errors import HFValidationError
from safetensors import SafetensorError
from torch import nn

from foresight.cadence import Regime, check_budget
from foresight.choices import Choice
from foresight.models import describe, float_dtype
from foresight.scorer.attention_features import FEATURE_NAMES, FeatureSet, feature_width


class HasModelShape(Protocol):
    """What a scorer must agree on with the model it scores (`foresight.models.ModelShape` has it)."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int


def _shape_key(shape: HasModelShape) -> tuple[int, int, int, int]:
    return shape.num_layers, shape.num_query_heads, shape.num_kv_heads, shape.head_dim


def describe_shape(shape: HasModelShape) -> str:
    """One-line description of a model shape, as error messages print it."""
    return "layers={}, query heads={}, KV heads={}, head dim={}".format(*_shape_key(shape))


STAGES = ("supervised", "reinforcement")
"""The training stages that make a scorer (ForesightKV §3.2 and §3.3)."""


class ScoreScale(Choice):
    """What a scorer's keep scores mean beyond their order inside one (layer, KV head).

    "ordinal": trained by the ranking loss alone, whose pairs never leave a head, so scores of two heads do not
    compare (the output bias is never trained). "log-target": also regressed on log(α + ε) of each candidate
    (`trainers.supervised`), output bias included, so a score estimates the log of the entry's future attention
    on one scale for every head and layer: what spending one budget across heads needs."""

    ORDINAL = "ordinal"
    LOG_TARGET = "log-target"


@dataclass
class ScorerConfig:
    """Everything needed to rebuild a scorer and to refuse a model it was not trained for.

    num_layers, num_query_heads, num_kv_heads, head_dim: the base model's shape (Hq must be a multiple
    of Hkv; G = Hq / Hkv). budget (B) and interval (L): the eviction cadence it was trained with
    (B > L >= 1). base_model: the model id or path it was trained on (informative). hidden: H, the MLP
    width (16 in the paper). feature_set: "paper" (F = 6), "official-8" or "pooled" (F = 8), "standardised"
    (F = 7), "standardised-heuristic" (F = 9) or "standardised-norms" (F = 7; the standardised sets' scorers
    also read each key and value at unit L2 norm, `UNIT_EPS`, and the last one their log norms too). stage: the training
    stage that made the weights, "supervised" (§3.2) or "reinforcement" (§3.3); started_from: the
    scorer the reinforcement stage started from, by the hash of its weights and the folder or Hub id it
    was read from (`named_by_content`; older scorers hold the path only; None for the supervised stage).
    training_sources: the prompt sources of the traces it was trained on (informative; empty when not
    recorded). key_values: whether x_n holds the entry's key and value (True, the paper's x_n) or only its
    attention features (False: an ablation whose scorer cannot key on token content or on the absolute
    position that RoPE rotates into the keys). regime: the eviction regime whose steps its training examples
    came from (`foresight.cadence.Regime`; scorers written before the regimes hold none and are streaming).
    scale: what its scores mean across heads (`ScoreScale`; older scorers hold none and are ordinal).
    residual: a feature of the set ("last_1": TOVA's statistic, the newest query's attention) whose columns'
    mean over the group's query heads is added to the MLP's output, the output layer starting at 0: the scorer
    starts as that heuristic's order (per KV head, on the standardised log scale) and trains as a correction to
    it, so off its training distribution it stays near the heuristic rather than below it (None: the MLP alone).
    sums_dtype: the dtype the learned policy holds this scorer's bounded sums at unless told otherwise
    (`Foresight.sums_dtype`): "float32" (older scorers hold none), or a 16-bit dtype where the state gate passed
    it for this scorer (scripts/state_gate.py).
    """

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    budget: int
    interval: int
    base_model: str
    hidden: int = 16
    feature_set: FeatureSet = FeatureSet.PAPER
    stage: str = "supervised"
    started_from: str | None = None
    training_sources: list[str] = field(default_factory=list)
    key_values: bool = True
    regime: Regime = Regime.STREAMING
    scale: ScoreScale = ScoreScale.ORDINAL
    residual: str | None = None
    sums_dtype: str = "float32"

    def __post_init__(self) -> None:
        self.feature_set = FeatureSet.parse(self.feature_set)
        float_dtype("sums_dtype", self.sums_dtype)
        names = FEATURE_NAMES[self.feature_set]
        if self.residual is not None and self.residual not in names:
            raise ValueError(
                f"residual {self.residual!r} is not a feature of the {self.feature_set.value} set; its features: "
                f"{', '.join(names)}"
            )
        self.regime = Regime.parse(self.regime)
        self.scale = ScoreScale.parse(self.scale)
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(map(repr, STAGES))}, got {self.stage!r}")
        for name in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"num_query_heads={self.num_query_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not isinstance(self.key_values, bool):
            raise ValueError(f"key_values must be true or false, got {self.key_values!r}")
        check_budget(self.budget, self.interval)

    @property
    def group_size(self) -> int:
        """G, query heads per KV head."""
        return self.num_query_heads // self.num_kv_heads

    @property
    def feature_width(self) -> int:
        """F*G, the width of a_n (F for the grouped set)."""
        return feature_width(self.feature_set, self.group_size)

    @property
    def norm_width(self) -> int:
        """How many log norms x_n ends with: 2, log‖k_n‖ and log‖v_n‖ (`FeatureSet.key_value_norms`); 3, those
        and log‖W_o v_n‖ (`FeatureSet.projected_key_values`); else 0."""
        if not self.key_values:
            return 0
        return 3 if self.feature_set.projected_key_values else 2 * self.feature_set.key_value_norms

    @property
    def vector_width(self) -> int:
        """2D when x_n holds the key and value vectors themselves, else 0 (features only, or their projections)."""
        return 2 * self.head_dim * (self.key_values and not self.feature_set.projected_key_values)

    @property
    def residual_columns(self) -> slice | None:
        """The columns of a_n holding the residual feature, one per query head of the group (head-major layout)."""
        if self.residual is None:
            return None
        names = FEATURE_NAMES[self.feature_set]
        return slice(names.index(self.residual), None, len(names))

    @property
    def input_dim(self) -> int:
        """2D + F*G (+ 2 log norms), the width of x_n (F*G without keys and values; F*G + 3 for the projections)."""
        return self.vector_width + self.feature_width + self.norm_width


UNIT_EPS = 1e-6
"""The smallest norm a key or value is divided by (a zero key stays zero).

Why the standardised set's scorer reads unit-norm keys and values: their norms differ by orders of
magnitude across models, layers and heads (outlier channels, sinks), which a scorer fitted on one
model's heads does not transfer; the direction keeps the content, and how strongly an entry is read is
in the attention features. Per entry, not over the candidates, so a recorded eviction pool
(`SampledEviction`) scores exactly as at sampling time."""


def _by_head(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[layers, batch, Hkv, N, W] -> [layers * Hkv, batch * N, W] in `dtype`: cast and laid out in one copy,
    or a view where the tensor already is in `dtype` and that layout (one sequence at inference)."""
    count, batch, heads, entries, width = tensor.shape
    by_head = tensor.permute(0, 2, 1, 3, 4)
    if tensor.dtype == dtype:
        return by_head.reshape(count * heads, batch * entries, width)
    grouped = torch.empty(count, heads, batch, entries, width, dtype=dtype, device=tensor.device)
    return grouped.copy_(by_head).view(count * heads, batch * entries, width)


class ForesightScorer(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="foresightkv",
    tags=["kv-cache", "kv-cache-eviction", "foresightkv"],
):
    """All (layer, KV head) scoring MLPs of one base model as a single module (see module docstring)."""

    def __init__(self, config: ScorerConfig) -> None:
        super().__init__()
        self.config = config
        layers, heads, hidden = config.num_layers, config.num_kv_heads, config.hidden
        self.w1 = nn.Parameter(torch.empty(layers, heads, config.input_dim, hidden))
        self.b1 = nn.Parameter(torch.empty(layers, heads, hidden))
        self.w2 = nn.Parameter(torch.empty(layers, heads, hidden))
        self.b2 = nn.Parameter(torch.empty(layers, heads))
        if config.feature_set.projected_key_values and config.key_values:
            # Not trained: the base model's output projection, saved with the weights (`set_output_factors`).
            dim = config.head_dim
            self.register_buffer("output_factors", torch.full((layers, heads, dim, dim), float("nan")))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init, per (layer, head): U(-1/sqrt(fan_in), 1/sqrt(fan_in)); with a residual the
        output layer starts at 0, so the scores start as the residual feature's."""
        layers = ((self.w1, self.b1, self.config.input_dim), (self.w2, self.b2, self.config.hidden))
        with torch.no_grad():
            for weight, bias, fan_in in layers:
                weight.uniform_(-(fan_in**-0.5), fan_in**-0.5)
                bias.uniform_(-(fan_in**-0.5), fan_in**-0.5)
            if self.config.residual is not None:
                self.w2.zero_()
                self.b2.zero_()

    @property
    def needs_output_factors(self) -> bool:
        """Whether this scorer reads log‖W_o v‖ and its output factors are not set yet (`set_output_factors`)."""
        factors = getattr(self, "output_factors", None)
        return factors is not None and bool(factors.isnan().any())

    def set_output_factors(self, model: nn.Module) -> None:
        """Take log‖W_o v‖'s factors from `model` (a decoder whose attention layers have an `o_proj`): per (layer,
        KV head) R [D, D] with ‖R v‖ = ‖W v‖, W [G * hidden, D] the output projection's columns of the group's G
        query heads stacked, so ‖R v‖² = Σ_g ‖W_g v‖²: how far the entry's value can move the layer's output,
        whichever of the group's heads reads it. R is the triangular factor of W's QR decomposition (D x D
        instead of the projection's hidden x D)."""
        config = self.config
        self.check_compatible(describe(model))
        layers = model.get_decoder().layers
        with torch.no_grad():
            for index, layer in enumerate(layers):
                weight = layer.self_attn.o_proj.weight.detach().double()  # [hidden, Hq * D]
                heads = weight.unflatten(1, (config.num_kv_heads, config.group_size, config.head_dim))
                for head in range(config.num_kv_heads):
                    stacked = heads[:, head].transpose(0, 1).flatten(0, 1)  # [G * hidden, D]
                    factor = torch.linalg.qr(stacked, mode="r").R
                    self.output_factors[index, head] = factor.to(self.output_factors.dtype)

    def check_compatible(self, shape: HasModelShape) -> None:
        """Raise a one-line ValueError naming both shapes when `shape` is not the model this scorer is for."""
        mine = self.config
        if _shape_key(mine) != _shape_key(shape):
            raise ValueError(
                f"scorer trained for {mine.base_model} ({describe_shape(mine)}) does not fit the model "
                f"({describe_shape(shape)})"
            )

    def score_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """KEEP scores of one layer's entries: keys, values [batch, Hkv, N, D], features [batch, Hkv, N, F*G]
        -> [batch, Hkv, N] (inference)."""
        self._check_inputs(keys, values, features, leading=1)
        return self.score_layers(layer, *(tensor.unsqueeze(0) for tensor in (keys, values, features)))[0]

    def score_layers(
        self, first: int, keys: torch.Tensor, values: torch.Tensor, features: torch.Tensor
    ) -> torch.Tensor:
        """KEEP scores of consecutive layers from `first` at once (inference: one eviction step of the model
        runs its layers' MLPs together): keys, values [layers, batch, Hkv, N, D], features
        [layers, batch, Hkv, N, F*G] -> [layers, batch, Hkv, N]."""
        self._check_inputs(keys, values, features, leading=2)
        last = first + keys.shape[0] - 1
        if first < 0 or last >= self.config.num_layers:
            raise ValueError(
                f"layer {first if first < 0 else last} out of range: the scorer has layers 0..{self.config.num_layers - 1}"
            )
        return self._mlp([keys, values, features], slice(first, last + 1))

    def forward(
        self, keys: torch.Tensor, values: torch.Tensor, features: torch.Tensor, layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """KEEP scores of every layer at once (training): keys, values [layers, batch, Hkv, N, D], features
        [layers, batch, Hkv, N, F*G] -> [layers, batch, Hkv, N]. The inputs may be in any float dtype
        (a half-precision example cache): they are cast to the parameters' dtype in the one copy that
        lays them out for the matmuls. `layers`: the scorer layers the inputs hold on dim 0, in that
        order (None: all; a subset when only some layers sampled their evictions)."""
        self._check_inputs(keys, values, features, leading=2)
        expected = self.config.num_layers if layers is None else len(layers)
        if keys.shape[0] != expected:
            raise ValueError(f"expected {expected} layers on dim 0, got {keys.shape[0]}")
        if layers is None:
            return self._mlp([keys, values, features], slice(None))
        if not all(0 <= layer < self.config.num_layers for layer in layers):
            raise ValueError(
                f"layers {list(layers)} out of range: the scorer has layers 0..{self.config.num_layers - 1}"
            )
        return self._mlp([keys, values, features], torch.tensor(list(layers), device=self.w1.device))

    def _check_inputs(self, keys: torch.Tensor, values: torch.Tensor, features: torch.Tensor, leading: int) -> None:
        """One-line ValueError naming the tensor whose shape does not fit x_n = [k_n || v_n || a_n]."""
        config = self.config
        layout = "[layers, batch, Hkv, N, *]" if leading == 2 else "[batch, Hkv, N, *]"
        widths = {"keys": config.head_dim, "values": config.head_dim, "features": config.feature_width}
        for (name, width), tensor in zip(widths.items(), (keys, values, features)):
            heads = tensor.shape[-3] if tensor.dim() >= 3 else None
            if tensor.dim() != leading + 3 or tensor.shape[-1] != width or heads != config.num_kv_heads:
                raise ValueError(
                    f"{name} must be {layout} with Hkv={config.num_kv_heads} and last dim {width}, "
                    f"got shape {tuple(tensor.shape)}"
                )
        if not keys.shape[:-1] == values.shape[:-1] == features.shape[:-1]:
            raise ValueError(
                f"keys {tuple(keys.shape)}, values {tuple(values.shape)} and features "
                f"{tuple(features.shape)} disagree before the last dim"
            )

    def _mlp(self, parts: list[torch.Tensor], layers: slice | torch.Tensor) -> torch.Tensor:
        """ForesightKV Eq. 22 for every (layer, head) of `layers` at once: parts (keys, values, features)
        [layers, batch, Hkv, N, *] -> [layers, batch, Hkv, N].

        Each (layer, head) is one matmul over all its batch's entries ([batch * N, in] x [in, H]), and
        W1 x_n is accumulated in place from its key, value and feature blocks, so neither x_n nor a
        partial sum of the hidden layer is ever copied: the hidden layer is one tensor written three
        times, which on a CPU saves the page faults of fresh [layers * Hkv, batch * N, H] sums. A key the
        standardised set reads at unit norm enters as k_n / |k_n|, divided on the narrower side of its matmul:
        after it, (k_n W) / |k_n|, when the hidden width H is below D (one member: a quarter of the divisions),
        before it when not (a fused ensemble)."""
        config = self.config
        w1, b1, w2, b2 = (weight[layers].flatten(0, 1) for weight in (self.w1, self.b1, self.w2, self.b2))
        count, batch, heads, entries = parts[0].shape[:4]
        grouped = [_by_head(part, w1.dtype) for part in (parts if config.key_values else parts[2:])]
        if config.feature_set.projected_key_values:
            vectors, grouped = grouped[:-1], grouped[-1:]
            widths = [config.feature_width] + [config.norm_width] * bool(vectors)
        else:
            vectors = []
            widths = [part.shape[-1] for part in grouped] + [config.norm_width] * bool(config.norm_width)
        blocks = w1.split(widths, dim=1)
        features = len(grouped) - 1
        hidden = torch.baddbmm(b1.unsqueeze(1), grouped[features], blocks[features])
        norms = []
        for part, block in zip(grouped[:features], blocks[:features]):
            if not config.feature_set.unit_key_values:
                hidden.baddbmm_(part, block)
                continue
            norm = torch.linalg.vector_norm(part, dim=-1, keepdim=True).clamp_min(UNIT_EPS)
            norms.append(norm.log())
            if block.shape[-1] < part.shape[-1]:  # (k / |k|) W = (k W) / |k|, divided where it is narrower
                hidden.addcdiv_(torch.bmm(part, block), norm)
            else:
                hidden.baddbmm_(part / norm, block)
        if vectors:  # the transfer set's projections: log‖k_n‖, log‖v_n‖, log‖W_o v_n‖
            norms = self._projections(*vectors, layers)
        if config.norm_width:  # log‖k_n‖, log‖v_n‖: the scale the unit vectors leave out
            hidden.baddbmm_(torch.cat(norms, dim=-1), blocks[-1])
        scores = torch.bmm(nn.functional.gelu(hidden), w2.unsqueeze(-1)).squeeze(-1) + b2.unsqueeze(-1)
        scores = scores.unflatten(0, (count, heads)).unflatten(-1, (batch, entries)).permute(0, 2, 1, 3)
        if config.residual_columns is None:
            return scores
        return scores + parts[2][..., config.residual_columns].to(scores.dtype).mean(-1)

    def _projections(
        self, keys: torch.Tensor, values: torch.Tensor, layers: slice | torch.Tensor
    ) -> list[torch.Tensor]:
        """log‖k_n‖, log‖v_n‖ and log‖W_o v_n‖ of keys, values [layers * Hkv, batch * N, D], each [..., 1]."""
        factors = self.output_factors[layers].flatten(0, 1).to(values.dtype)  # [layers * Hkv, D, D]
        outputs = torch.bmm(values, factors.transpose(-1, -2))
        return [
            torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(UNIT_EPS).log() for x in (keys, values, outputs)
        ]

    @classmethod
    def _from_pretrained(
        cls,
        *,
        model_id: str,
        revision: str | None,
        cache_dir: str | os.PathLike | None,
        force_download: bool,
        local_files_only: bool,
        token: str | bool | None,
        map_location: str = "cpu",
        **model_kwargs,
    ) -> "ForesightScorer":
        """Load model.safetensors strictly; never falls back to a pickled checkpoint."""
        model = cls(**model_kwargs)
        if os.path.isdir(model_id):
            weights = os.path.join(model_id, constants.SAFETENSORS_SINGLE_FILE)
        else:
            weights = hf_hub_download(
                repo_id=model_id,
                filename=constants.SAFETENSORS_SINGLE_FILE,
                revision=revision,
                cache_dir=cache_dir,
                force_download=force_download,
                token=token,
                local_files_only=local_files_only,
            )
        load_weights(model, weights, map_location)
        return model.eval()


# Eviction with a scorer (ForesightKV Eq. 2, App. B.2). Scores are KEEP scores [..., C] over the C
# candidates (any leading dims, e.g. [batch, Hkv]); `eligible` [..., C] (or anything that broadcasts to
# it, e.g. [C]) marks the candidates that may be evicted, so sinks or protected entries are never picked.
# Scores must be finite.


def weights_digest(scorer: "ForesightScorer") -> str:
    """SHA-256 of a scorer's weights (every tensor's name, dtype, shape and bytes, in name order): what names
    a scorer by its content, whichever folder or file format holds it."""
    digest = hashlib.sha256()
    for name, tensor in sorted(scorer.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def named_by_content(scorer: "ForesightScorer", source: str | os.PathLike) -> str:
    """How a refined scorer names its start: by the hash of its weights, then, for people, where it was read
    from ("sha256:<64 hex> (checkpoints/default)"); a path alone says nothing once its content changes."""
    return f"sha256:{weights_digest(scorer)} ({source})"


SCORER_FILES = (constants.CONFIG_NAME, constants.SAFETENSORS_SINGLE_FILE)
"""What a scorer folder holds (`ForesightScorer.save_pretrained`)."""

_WRITERS = "`foresight fit` and `foresight export` write one"


def _required_fields() -> list[str]:
    return [item.name for item in fields(ScorerConfig) if item.default is MISSING and item.default_factory is MISSING]


def read_scorer_config(config_file: Path) -> ScorerConfig:
    """The `ScorerConfig` of a scorer folder's config.json, or a one-line ValueError saying what the file is
    instead (not JSON, another artifact's config such as TriAttention's statistics, unknown fields)."""
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file} is not JSON ({error}); a scorer's config.json is; {_WRITERS}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{config_file} holds a {type(values).__name__}, not a scorer's config (a JSON object)")
    known = {item.name for item in fields(ScorerConfig)}
    missing = [name for name in _required_fields() if name not in values]
    unknown = sorted(set(values) - known)
    if missing or unknown:
        kind = f"format {values['format']!r}" if "format" in values else f"fields {', '.join(sorted(values)) or 'none'}"
        expected = ", ".join(_required_fields()) + (f", not {', '.join(unknown)}" if unknown else "")
        raise ValueError(
            f"{config_file} is not a scorer's config ({kind}): a scorer's config holds {expected}; {_WRITERS}"
        )
    try:
        return ScorerConfig(**values)
    except ValueError as error:
        raise ValueError(f"{config_file}: {error}") from None


def load_weights(scorer: ForesightScorer, weights: str | os.PathLike, device: str | torch.device = "cpu") -> None:
    """Load model.safetensors into `scorer` strictly (every tensor present, no other, each of its config's
    shape), or a one-line ValueError: a truncated or foreign file (a broken download) or weights of
    another config."""
    try:
        safetensors.torch.load_model(scorer, weights, strict=True, device=device)
    except SafetensorError as error:
        raise ValueError(
            f"{weights} is not a complete safetensors file ({error}); expected the weights that `foresight fit` "
            "or `foresight export` wrote beside config.json (a broken download? fetch it again)"
        ) from None
    except RuntimeError as error:
        reason = " ".join(str(error).split())
        raise ValueError(
            f"{weights} does not hold the weights of the scorer its config.json describes ({reason[:300]})"
        ) from None


def _scorer_folder(source: str | os.PathLike) -> Path:
    """The local folder of a scorer: `source` itself, or the Hub snapshot holding its two files."""
    path = Path(source)
    if path.exists():
        missing = [name for name in SCORER_FILES if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{path} is not a scorer folder (no {' or '.join(missing)}); {_WRITERS}")
        return path
    try:
        files = [hf_hub_download(repo_id=os.fspath(source), filename=name) for name in SCORER_FILES]
    except (OSError, HFValidationError) as error:
        reason = " ".join(str(error).split()[:12])
        raise ValueError(
            f"cannot load a scorer from {os.fspath(source)!r}: no such folder, and not a reachable Hub repo ({reason})"
        ) from None
    return Path(files[0]).parent


def load_scorer(source: str | os.PathLike) -> ForesightScorer:
    """A scorer from a Hub-format folder (config.json + model.safetensors) or, for a path that does not
    exist locally, a Hub repo id. Every verb that takes a scorer loads it here, so a broken or foreign
    folder is one line, whichever verb reads it."""
    folder = _scorer_folder(source)
    scorer = ForesightScorer(read_scorer_config(folder / constants.CONFIG_NAME))
    load_weights(scorer, folder / constants.SAFETENSORS_SINGLE_FILE)
    return scorer.eval()
