"""A keras-hub model in the transformers format (`hf/`) and its LoRA as a PEFT adapter
(`hf-adapter/`), each loaded by `transformers` (and `peft`) on CPU torch, their logits
against keras-hub's own on the same tokens: a tiny Llama 2-style `LlamaBackbone` preset
(which keras-hub's exporter refuses; grouped-query attention and a rope wavelength of its
own), a tiny Gemma preset, and a run of a tiny Llama 3 from a
transformers-format checkpoint (`cluster=inprocess`), whose adapter loads onto that
checkpoint."""

import json
import os
from importlib.util import find_spec

import pytest

pytest.importorskip("keras_hub")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.conftest import run_config  # noqa: E402
from tests.hub_presets import (  # noqa: E402
    SEQ_LEN,
    transformers_logits,
    write_instructions,
    write_preset,
    write_transformers_llama,
)
from training.checkpoint.hf_export import export_for_transformers  # noqa: E402
from training.models.hub import causal_lm  # noqa: E402
from training.run import run_training  # noqa: E402

# torch and transformers load each export: the full suite's. Looked for, not imported, here:
# importing them (and peft) costs every collection of the suite, the quick one too, seconds.
MISSING = [name for name in ("torch", "transformers", "peft") if find_spec(name) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"not installed: {', '.join(MISSING)}"),
]

FLOAT32_BOUND = 1e-4  # the issue's target, in logits' absolute difference
LLAMA2_SIZES = dict(num_key_value_heads=2, rope_max_wavelength=500)


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    return {
        "llama2": write_preset("llama", root / "llama2", **LLAMA2_SIZES),
        # As Gemma 2B: multi-query attention (keras-hub's Gemma export writes one k/v head),
        # no space added before the text (transformers' Gemma tokenizer adds none)
        "gemma": write_preset(
            "gemma",
            root / "gemma",
            tokenizer_options={"add_dummy_prefix": False},
            num_key_value_heads=1,
        ),
        "transformers": write_transformers_llama(root / "transformers"),
        "jsonl": write_instructions(root / "train.jsonl"),
    }


def tokens(vocabulary: int) -> np.ndarray:
    return np.random.default_rng(0).integers(4, vocabulary, size=(2, 12)).astype("int32")


def with_lora_moved(model, seed: int = 1):
    """Every LoRA matrix given a value of its own (b starts at zero: LoRA would add nothing)."""
    rng = np.random.default_rng(seed)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(scale=0.05, size=variable.shape).astype("float32"))
    return model


def hub_model(preset, lora_rank: int = 0):
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(3)
    return causal_lm(preset=str(preset), lora_rank=lora_rank)


@pytest.mark.parametrize("family", ["llama2", "gemma"])
def test_a_lora_model_and_its_adapter_load_in_transformers_with_keras_hubs_logits(
    presets, tmp_path, family
):
    """hf/ (LoRA merged) in transformers, and hf-adapter/ with peft onto the base model
    exported the same way: both give the keras-hub model's logits; the tokenizer's files
    give keras-hub's token ids."""
    from transformers import AutoTokenizer

    base = export_for_transformers(hub_model(presets[family]), str(tmp_path / "base"), "")
    assert base == {"model": str(tmp_path / "base" / "hf"), "adapter": None, "not_written": []}
    model = with_lora_moved(hub_model(presets[family], lora_rank=4))
    written = export_for_transformers(model, str(tmp_path), base["model"])
    assert written["not_written"] == []
    x = tokens(64)
    expected = np.asarray(model(x))
    merged = transformers_logits(written["model"], x)
    adapted = transformers_logits(base["model"], x, adapter=written["adapter"])
    without = transformers_logits(base["model"], x)
    differences = [np.max(np.abs(logits - expected)) for logits in (merged, adapted)]
    print(f"{family} float32 logits: max abs difference {differences} (hf/, hf-adapter/)")
    assert max(differences) <= FLOAT32_BOUND
    assert np.max(np.abs(without - expected)) > 100 * FLOAT32_BOUND  # LoRA mattered
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "float32"
    tokenizer = AutoTokenizer.from_pretrained(written["model"])
    keras_tokenizer = model.task.preprocessor.tokenizer
    text = "the owl number 7 jumps over the river"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(
        np.asarray(keras_tokenizer(text))
    )


def test_a_bfloat16_model_is_written_in_bfloat16(presets, tmp_path):
    """A model computing in bfloat16 (its variables float32, Keras' mixed policy): its
    weights in bfloat16, and transformers in bfloat16 gives its logits within bfloat16's
    rounding."""
    from safetensors import safe_open

    keras.config.set_dtype_policy("mixed_bfloat16")
    model = with_lora_moved(hub_model(presets["llama2"], lora_rank=4))
    written = export_for_transformers(model, str(tmp_path), "")
    with safe_open(os.path.join(written["model"], "model.safetensors"), "np") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    x = tokens(64)
    expected = np.asarray(model(x), np.float32)
    loaded = transformers_logits(written["model"], x, dtype="bfloat16")
    difference = np.max(np.abs(loaded - expected))
    print(f"bfloat16 logits: max abs difference {difference:.3g}")
    assert difference < 0.03 * np.max(np.abs(expected))


TINY = dict(vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32)
NOT_WRITTEN = {
    # keras-hub has no exporter for OPT
    "OPTBackbone": (
        dict(num_heads=2, max_sequence_length=SEQ_LEN),
        "no transformers export for OPTBackbone",
    ),
    # keras-hub's Gemma export writes one key/value head
    "GemmaBackbone": (
        dict(num_query_heads=2, num_key_value_heads=2, head_dim=8),
        "writes one key/value head (Gemma 2B's multi-query attention); this model has 2",
    ),
    # keras-hub's Llama does not apply linear rope scaling; transformers would
    "LlamaBackbone": (
        dict(num_query_heads=2, num_key_value_heads=2, rope_position_scaling_factor=2.0),
        "rope_position_scaling_factor=2.0, which keras-hub's Llama does not apply",
    ),
}


@pytest.mark.parametrize("backbone", NOT_WRITTEN)
def test_a_model_transformers_would_not_compute_writes_nothing_and_says_why(tmp_path, backbone):
    sizes, why = NOT_WRITTEN[backbone]
    keras.distribution.set_distribution(None)
    model = causal_lm(backbone=backbone, **TINY, **sizes)
    written = export_for_transformers(model, str(tmp_path), "")
    assert written["model"] is None and list(tmp_path.iterdir()) == []
    assert why in written["not_written"][0]


def test_a_lora_run_from_a_transformers_checkpoint_writes_both_beside_its_preset(presets, tmp_path):
    """A LoRA fine-tune (cluster=inprocess) of a Llama 3 read from a transformers-format
    checkpoint: its hf/ and, with peft, that checkpoint with its hf-adapter/ give the
    exported preset's logits in plain keras-hub; the summary names both."""
    import keras_hub

    checkpoint = presets["transformers"]
    summary = run_training(
        run_config(
            [
                "cluster=inprocess",
                "model=hub",
                f"model.preset={checkpoint}",
                "model.lora_rank=4",
                f"model.seq_len={SEQ_LEN}",
                "data=jsonl",
                f"data.path={presets['jsonl']}",
                "trainer.global_batch=8",
                "trainer.steps=3",
                "optimizer.learning_rate=0.05",
                f"export.dir={tmp_path}",
            ]
        ),
        tmp_path / "run",
    )
    assert summary["status"] == "completed"
    written = summary["hf_export"]
    assert written == {
        "model": str(tmp_path / "hf"),
        "adapter": str(tmp_path / "hf-adapter"),
        "not_written": [],
    }
    adapter_config = json.loads((tmp_path / "hf-adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(checkpoint)
    keras.distribution.set_distribution(None)
    trained = keras_hub.models.CausalLM.from_preset(summary["exported_model"], preprocessor=None)
    x = tokens(256)
    expected = np.asarray(trained({"token_ids": x, "padding_mask": np.ones_like(x)}))
    untrained = transformers_logits(checkpoint, x)
    assert np.max(np.abs(untrained - expected)) > 100 * FLOAT32_BOUND  # training moved them
    merged = transformers_logits(written["model"], x)
    adapted = transformers_logits(checkpoint, x, adapter=written["adapter"])
    differences = [np.max(np.abs(logits - expected)) for logits in (merged, adapted)]
    print(f"run float32 logits: max abs difference {differences} (hf/, hf-adapter/)")
    assert max(differences) <= FLOAT32_BOUND
