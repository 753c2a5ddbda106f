"""keras-hub backbones (`model=hub`): the causal-LM wrapper, the backbone's own layout on our
(data, model) mesh, checked on the live arrays, and a few training steps. In-process, no Ray."""

import json
import re

import pytest

pytest.importorskip("keras_hub")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tests.conftest import compose_config  # noqa: E402
from training.config import ConfigError, HubModelConfig  # noqa: E402
from training.models import hub  # noqa: E402

TINY_LLAMA = dict(
    vocabulary_size=256,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=64,
    intermediate_dim=128,
)
SEQ_LEN = 16
BATCH = 8


@pytest.fixture
def llama_on_mesh():
    """A tiny Llama causal LM built under ModelParallel with LlamaBackbone's own layout on a
    (data=2, model=4) mesh of the 8 CPU devices."""
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"], devices=jax.devices())
    layouts = hub.layout_map(mesh, "LlamaBackbone", **TINY_LLAMA)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layouts, batch_dim_name="data", auto_shard_dataset=False
        )
    )
    try:
        keras.utils.set_random_seed(0)
        yield hub.causal_lm("LlamaBackbone", **TINY_LLAMA), layouts
    finally:
        keras.distribution.set_distribution(None)


def test_backbone_layout_splits_the_live_variables(llama_on_mesh):
    model, layouts = llama_on_mesh
    specs = {v.path: tuple(v.value.sharding.spec) for v in model.variables}
    # Every key of the map lays out some variable: keras full-matches the keys against
    # variable.path, and one matching nothing would leave its variables replicated unnoticed.
    for key in layouts:
        assert any(re.fullmatch(key, path) for path in specs), f"{key!r} matches no variable"
    for path, spec in specs.items():
        expected = layouts[path]
        assert spec == (tuple(expected.axes) if expected else (None,) * len(spec)), path
    # What LlamaBackbone.get_layout_map (keras-hub 0.32) says, on our axis names.
    assert specs["token_embedding/embeddings"] == ("model", "data")
    assert specs["token_embedding/reverse_embeddings"] == ("data", "model")  # added by hub.py
    layer = "transformer_layer_1"
    for name in ("query", "key", "value"):
        assert specs[f"{layer}/self_attention/{name}/kernel"] == ("model", "data", None)
    assert specs[f"{layer}/self_attention/attention_output/kernel"] == ("model", None, "data")
    assert specs[f"{layer}/feedforward_intermediate_dense/kernel"] == ("data", "model")
    assert specs[f"{layer}/feedforward_gate_dense/kernel"] == ("data", "model")
    assert specs[f"{layer}/feedforward_output_dense/kernel"] == ("model", "data")
    # Left whole: only the norms' scale vectors.
    replicated = sorted(path for path, spec in specs.items() if not any(spec))
    assert all(path.endswith("layernorm/scale") for path in replicated), replicated


def test_llama_causal_lm_trains_on_the_mesh(llama_on_mesh):
    model, _ = llama_on_mesh
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=hub.loss())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY_LLAMA["vocabulary_size"], (BATCH, SEQ_LEN + 1), dtype="int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = [float(model.train_on_batch(x, y)) for _ in range(6)]
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.5, losses


def test_unknown_backbone_lists_some():
    with pytest.raises(ConfigError, match="NoSuchBackbone.*LlamaBackbone"):
        hub.causal_lm("NoSuchBackbone")


def test_backbone_without_its_own_layout_asks_for_rules():
    assert not hasattr(hub._keras_hub().models.GPT2Backbone, "get_layout_map")
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"], devices=jax.devices())
    with pytest.raises(ConfigError, match="GPT2Backbone has no layout of its own.*layout_rules"):
        hub.layout_map(mesh, "GPT2Backbone")


def test_hub_config_composes():
    model = OmegaConf.to_object(compose_config(["model=hub"]).model)
    assert isinstance(model, HubModelConfig)
    no_lora = {"lora_rank": 0, "lora_targets": [], "attention": "auto"}
    assert model.build_kwargs() == {"backbone": "LlamaBackbone", **TINY_LLAMA, **no_lora}
    assert model.layout_kwargs() == {"backbone": "LlamaBackbone", **TINY_LLAMA}
    with_preset = OmegaConf.to_object(
        compose_config(["model=hub", "model.preset=/presets/gemma"]).model
    )
    # The preset's backbone and sizes, not the yaml's random-weights Llama.
    assert with_preset.build_kwargs() == {"preset": "/presets/gemma", **no_lora}
    with pytest.raises(ConfigError, match="model.attention=.flash. is not one of auto, fused"):
        OmegaConf.to_object(compose_config(["model=hub", "model.attention=flash"]).model)


def test_token_windows_are_fed_with_an_all_ones_padding_mask():
    """One array of token ids (data=text, data=tokens) reaches keras-hub's LlamaCausalLM as
    token ids with a padding mask of ones; a dict goes through as it is."""
    keras.utils.set_random_seed(0)
    model = hub.causal_lm("LlamaBackbone", **TINY_LLAMA)
    assert isinstance(model.task, hub._keras_hub().models.LlamaCausalLM)
    tokens = np.random.default_rng(1).integers(0, 256, (2, SEQ_LEN), dtype="int32")
    expected = model.task({"token_ids": tokens, "padding_mask": np.ones_like(tokens)})
    np.testing.assert_allclose(model(tokens), expected, rtol=1e-5, atol=1e-5)
    half = np.repeat([[1] * (SEQ_LEN // 2) + [0] * (SEQ_LEN // 2)], 2, axis=0)
    masked = model({"token_ids": tokens, "padding_mask": half})
    assert not np.allclose(masked, expected, atol=1e-3)


@pytest.mark.ray
def test_lora_fine_tuning_of_a_preset_on_two_hosts_trains_only_lora_and_exports_a_preset(
    ray_cluster, tmp_path, capsys
):
    """A tiny Llama preset with LoRA, instruction-tuned from a JSON-lines file under hybrid
    2 hosts × 4 devices: its own layout on the live arrays; each host fed its own half of
    every batch; the loss falls; only the LoRA matrices change and only they have optimizer
    state; the exported preset, loaded with plain keras-hub on one device without LoRA,
    gives the trained model's logits, and `training.generate` samples from it."""
    import keras_hub

    from tests.conftest import run_config
    from tests.hub_presets import transformers_logits, write_instructions, write_preset
    from training import generate
    from training.data import build_dataset
    from training.export import export_checkpoint, restored_model
    from training.run import run_training

    preset = write_preset("llama", tmp_path / "llama")
    overrides = [
        "model=hub",
        f"model.preset={preset}",
        "model.lora_rank=4",
        "model.seq_len=16",
        "data=jsonl",
        f"data.path={write_instructions(tmp_path / 'train.jsonl')}",
        "data.prompt_field=prompt",
        "data.response_field=response",
        "strategy=hybrid",
        "mesh.data=2",
        "mesh.model=4",
        "optimizer=adamw",
        "optimizer.learning_rate=0.02",
        "trainer.steps=8",
        "trainer.log_interval=1",
        "trainer.global_batch=16",
        "trainer.eval_batches=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    summary = run_training(run_config(overrides), tmp_path / "run")
    assert summary["status"] == "completed"
    shardings = summary["variable_shardings"]
    assert shardings["token_embedding/embeddings"] == "P('model', 'data')"
    assert (
        shardings["transformer_layer_0/self_attention/query/kernel"] == "P('model', 'data', None)"
    )
    assert shardings["transformer_layer_1/feedforward_gate_dense/kernel"] == "P('data', 'model')"
    losses = summary["loss_history"]
    assert losses[-1] < losses[0] - 0.2, losses
    lora = [p for p in summary["variables"] if "lora_kernel" in p]
    assert len(lora) == 8  # a and b of query and value, in 2 layers
    assert summary["parameters_trained"] == sum(
        np.prod(summary["variables"][p]["shape"]) for p in lora
    )
    slots = [p for p in summary["optimizer_variables"] if p.endswith(("momentum", "velocity"))]
    assert len(slots) == 2 * len(lora) and all("lora_kernel" in p for p in slots), slots

    dataset = build_dataset(run_config(overrides).data)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    for step, line in enumerate(lines):
        first, second = json.loads(line)["rows_fed"]
        expected = dataset.rows("train", step, 16, slice(0, 16)).tolist()
        assert (first, second) == (expected[:8], expected[8:]), step

    keras.distribution.set_distribution(None)
    _, trained = restored_model(str(tmp_path / "ckpt"))
    pretrained = keras_hub.models.CausalLM.from_preset(str(preset), preprocessor=None)
    base = {v.path: np.asarray(v.value) for v in pretrained.variables}
    compared = [v for v in trained.variables if v.path in base]
    assert len(compared) == len(base)
    for variable in compared:
        np.testing.assert_array_equal(np.asarray(variable.value), base[variable.path])
    exported = summary["exported_model"]
    assert exported == str(tmp_path / "run" / "preset")
    plain = keras_hub.models.CausalLM.from_preset(exported)
    assert not plain.backbone.trainable_weights or all(
        "lora" not in v.path for v in plain.backbone.weights
    )
    x, _, _ = dataset.batch("held_out", 0, 4, slice(0, 4))
    np.testing.assert_allclose(plain(x), trained(x), rtol=1e-4, atol=1e-5)
    assert not np.allclose(pretrained(x), trained(x), atol=1e-3)
    # The 2 hosts wrote hf/ too (each weight whole from host 0): transformers' logits.
    ids = np.asarray(x["token_ids"])
    hf = summary["hf_export"]
    assert hf["model"] == str(tmp_path / "run" / "hf") and hf["adapter"]
    plain_logits = plain({"token_ids": ids, "padding_mask": np.ones_like(ids)})
    np.testing.assert_allclose(transformers_logits(hf["model"], ids), plain_logits, atol=1e-4)
    # training.export writes the same preset from the checkpoint, without a cluster, and
    # hf/ beside it.
    from_checkpoint, hf = export_checkpoint(str(tmp_path / "ckpt"))
    assert from_checkpoint == str(tmp_path / "ckpt" / "preset")
    again = keras_hub.models.CausalLM.from_preset(from_checkpoint)
    np.testing.assert_allclose(again(x), plain(x), rtol=1e-5, atol=1e-6)
    assert hf["model"] == str(tmp_path / "ckpt" / "hf")
    np.testing.assert_allclose(transformers_logits(hf["model"], ids), plain_logits, atol=1e-4)

    capsys.readouterr()
    assert generate.main([exported, "the fox", "--max-length", "8"]) == 0
    # Its last line: a Ray worker's log line forwarded meanwhile may come before it
    assert capsys.readouterr().out.splitlines()[-1].startswith("the fox")


# The plan of the tiny Llama under hybrid 2 × 4 against its compiled step.
LLAMA_PLAN = ("model=hub", "data=text", "model.seq_len=32")


def llama_plan_and_step(layout: str):
    from tests.planning.test_plan import plan_and_step
    from training.parallel.mesh import MeshShape

    return plan_and_step("hybrid", MeshShape(2, 4), (*LLAMA_PLAN, f"strategy.layout={layout}"))


def model_axis_bytes(found) -> float:
    """Bytes sent in the collectives over the model axis (groups of 4; the data axis's are 2)."""
    from training.planning.collectives import sent_bytes

    return sent_bytes([c for c in found if c.group == 4])


@pytest.mark.slow
def test_plan_of_the_llama_with_an_auto_layout_matches_its_compiled_step():
    """The decoder blocks followed through (rotary embeddings, the causal mask, grouped-query
    repeat, dot_product_attention): every collective the step sends is predicted."""
    predicted, measured = llama_plan_and_step("auto")
    assert predicted.sent_bytes == pytest.approx(measured.sent_bytes, rel=0.10)


@pytest.mark.slow
def test_plan_of_the_llama_with_its_own_layout_predicts_the_model_axis():
    predicted, measured = llama_plan_and_step("model")
    assert model_axis_bytes(predicted.collectives) == pytest.approx(
        model_axis_bytes(measured.collectives), rel=0.10
    )


def test_plan_of_the_llama_with_its_own_layout_predicts_the_whole_step():
    """keras-hub's rules split weights over `data` too: the step gathers them (FSDP), and the
    output rules keep the activations where the plan has them, so that XLA's choices are
    those the plan makes (the query, key and value kernels gathered over `model`, smaller
    than their partial sums)."""
    predicted, measured = llama_plan_and_step("model")
    assert predicted.sent_bytes == pytest.approx(measured.sent_bytes, rel=0.10)
