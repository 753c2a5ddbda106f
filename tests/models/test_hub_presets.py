"""keras-hub presets in: a tiny Gemma and a tiny Llama preset written here offline
(`tests/hub_presets.py`), and a tiny Llama in the transformers format (a Hugging Face
checkpoint), loaded with `model.preset` on the 8 in-process CPU devices under
model parallel 1 × 8 and hybrid 2 × 4, compared with the same preset on one device; text
from a JSON-lines file through the preset's tokenizer; LoRA; weights from `model.init_from`;
a user's own build function that loads a preset and adds LoRA. No Ray."""

import json
import re
import shutil
import textwrap

import pytest

pytest.importorskip("keras_hub")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.conftest import run_config, run_plain_python  # noqa: E402
from tests.hub_presets import (  # noqa: E402
    SEQ_LEN,
    write_instructions,
    write_preset,
    write_transformers_llama,
)
from training.build import build_compiled, build_on_grid  # noqa: E402
from training.config import ConfigError  # noqa: E402
from training.data import build_dataset  # noqa: E402
from training.driver.preflight import preflight  # noqa: E402

BATCH = 8


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    return {
        "gemma": write_preset("gemma", root / "gemma"),
        "llama": write_preset("llama", root / "llama"),
        "no_tokenizer": write_preset("gemma", root / "bare", with_tokenizer=False),
        "transformers": write_transformers_llama(root / "transformers"),
        "jsonl": write_instructions(root / "train.jsonl"),
    }


def preset_overrides(presets, family: str, *more: str) -> list[str]:
    return [
        "model=hub",
        f"model.preset={presets[family]}",
        f"model.seq_len={SEQ_LEN}",
        "data=jsonl",
        f"data.path={presets['jsonl']}",
        "cluster.hosts=1",
        "cluster.devices_per_host=8",
        f"trainer.global_batch={BATCH}",
        *more,
    ]


def one_device_loss(preset, x, y, weights) -> float:
    """keras-hub's own CausalLM from the preset, on one device, its cross-entropy averaged by
    hand over the weighted tokens."""
    import keras_hub

    keras.distribution.set_distribution(None)
    model = keras_hub.models.CausalLM.from_preset(str(preset), preprocessor=None)
    logits = np.asarray(model(x), np.float64)
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[..., None]
        - logits.max(-1, keepdims=True)
    )
    picked = np.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
    return float(-(picked * weights).sum() / weights.sum())


def grid_of(data: int, model: int) -> np.ndarray:
    return np.array(jax.devices()).reshape(data, model)


BACKBONES = {"gemma": "GemmaBackbone", "llama": "LlamaBackbone", "transformers": "Llama3Backbone"}


@pytest.mark.parametrize(
    "family,strategy,shape",
    [
        ("gemma", "model_parallel", (1, 8)),
        ("gemma", "hybrid", (2, 4)),
        ("llama", "model_parallel", (1, 8)),
        # A Llama too (Llama3Backbone, under LlamaBackbone's layout), which keras-hub
        # converts from the transformers format as it loads
        ("transformers", "hybrid", (2, 4)),
    ],
    ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else value,
)
@pytest.mark.slow
def test_a_preset_loads_laid_out_by_its_backbone_and_its_first_loss_is_one_devices(
    presets, family, strategy, shape
):
    import keras_hub

    cfg = run_config(
        preset_overrides(
            presets,
            family,
            f"strategy={strategy}",
            f"mesh.data={shape[0]}",
            f"mesh.model={shape[1]}",
            "optimizer.learning_rate=0.01",
        )
    )
    try:
        model, dataset = build_on_grid(cfg, grid_of(*shape))
        specs = {v.path: tuple(v.value.sharding.spec) for v in model.variables}
        mesh = keras.distribution.DeviceMesh(shape, ["data", "model"], devices=jax.devices())
        backbone = type(model.task.backbone)
        assert backbone is getattr(keras_hub.models, BACKBONES[family])
        layouts = backbone.get_layout_map(mesh, "model", "data")
        for key in layouts:
            matched = [path for path in specs if re.fullmatch(key, path)]
            assert matched, key
            for path in matched:
                assert specs[path] == tuple(layouts[key].axes), path
        x, y, weights = dataset.batch("train", 0, BATCH, slice(0, BATCH))
        losses = [model.train_on_batch(x, y, weights, return_dict=True)["loss"] for _ in range(4)]
    finally:
        keras.distribution.set_distribution(None)
    assert losses[0] == pytest.approx(one_device_loss(presets[family], x, y, weights), rel=1e-4)
    assert losses[-1] < losses[0], losses


def test_the_driver_checks_a_transformers_checkpoint_without_reading_its_weights(presets, tmp_path):
    """keras-hub converts a transformers-format checkpoint as it reads it: the layout comes
    from its converted config (the untied output matrix split as the embedding, transposed),
    and the driver's build asks for no weight, so a weights file it could not read passes."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(presets["transformers"], checkpoint)
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    overrides = preset_overrides(
        {**presets, "transformers": checkpoint}, "transformers", "strategy=hybrid", "mesh.data=2"
    )
    checked = preflight(run_config([*overrides, "mesh.model=4"]))
    assert checked.rules["token_embedding/embeddings"] == ("model", "data")
    assert checked.rules["token_embedding/reverse_embeddings"] == ("data", "model")
    assert (
        checked.parameters["parameters"]
        == 2 * 260 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 128) + 64
    )


def test_text_is_packed_as_keras_hubs_preprocessor_packs_it(presets):
    """One text field: the rows equal keras-hub's own CausalLMPreprocessor's output."""
    import keras_hub

    dataset = build_dataset(run_config(preset_overrides(presets, "gemma")).data)
    x, y, weights = dataset.batch("held_out", 0, 4, slice(0, 4))
    lines = presets["jsonl"].read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines[-5:-1]]  # the held-out lines, in order
    preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(
        str(presets["gemma"]), sequence_length=SEQ_LEN
    )
    want_x, want_y, want_weights = preprocessor(texts)
    np.testing.assert_array_equal(x["token_ids"], want_x["token_ids"])
    np.testing.assert_array_equal(x["padding_mask"], want_x["padding_mask"])
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(weights, want_weights)
    assert dataset.spec.num_classes == preprocessor.tokenizer.vocabulary_size()


def test_a_bad_line_further_in_stops_a_host_naming_its_file_and_line(presets, tmp_path):
    lines = presets["jsonl"].read_text().splitlines()
    lines[2] = json.dumps({"body": "no text field"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    cfg = run_config(preset_overrides(presets, "gemma", f"data.path={bad}"))
    dataset = build_dataset(cfg.data)  # the first and last lines are fine
    rows = len(dataset.splits["train"].starts)
    with pytest.raises(ConfigError, match=rf"line 3 of {bad} has no text field 'text'"):
        for index in range(rows):
            dataset.batch("train", index, 1, slice(0, 1))


@pytest.mark.slow
def test_prompt_and_padding_carry_no_loss(presets):
    """A prompt and a response field: the run's loss on one device equals a cross-entropy
    over the response tokens only, masked by hand from the tokenized prompt and response."""
    import keras_hub

    cfg = run_config(
        preset_overrides(
            presets, "gemma", "data.prompt_field=prompt", "data.response_field=response"
        )
    )
    dataset = build_dataset(cfg.data)
    x, y, weights = dataset.batch("train", 0, 4, slice(0, 4))
    tokenizer = keras_hub.models.CausalLMPreprocessor.from_preset(str(presets["gemma"])).tokenizer
    records = [json.loads(line) for line in presets["jsonl"].read_text().splitlines()]
    by_hand = np.zeros_like(weights)
    for row, line in enumerate(dataset.rows("train", 0, 4, slice(0, 4))):
        prompt = len(tokenizer([records[line]["prompt"]])[0])
        response = len(tokenizer([records[line]["response"]])[0])
        # Labels are the next tokens: the prompt's last token predicts the response's first;
        # the response's last predicts the end token, which is learned too.
        first, last = prompt, min(prompt + response + 1, SEQ_LEN)
        by_hand[row, first:last] = 1
    assert by_hand.sum() > 0 and (by_hand == 0).any()
    keras.distribution.set_distribution(None)
    model = build_compiled(cfg, dataset.spec)
    loss = model.test_on_batch(x, y, weights, return_dict=True)["loss"]
    assert loss == pytest.approx(one_device_loss(presets["gemma"], x, y, by_hand), rel=1e-5)


USER_MODULE = '''
import keras
import keras_hub


def build(preset):
    """A user's fine-tuning model: a preset loaded with its weights, then LoRA added."""
    model = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    model.backbone.enable_lora(rank=4)
    return model


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def layout(device_mesh):
    return keras_hub.models.GemmaBackbone.get_layout_map(device_mesh, "model", "data")
'''


@pytest.mark.slow
def test_a_users_build_that_loads_a_preset_and_adds_lora_runs_under_model_parallel(
    presets, tmp_path, monkeypatch, counted_weight_reads
):
    """The driver's checks build it without reading a weight; on the 1 × 8 mesh it loads the
    preset's weights and only the LoRA matrices train."""
    (tmp_path / "my_lora.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    cfg = run_config(
        [
            "model=keras",
            "model.build=my_lora:build",
            "model.loss=my_lora:loss",
            "model.layout=my_lora:layout",
            f"+model.kwargs.preset={presets['gemma']}",
            "data=jsonl",
            f"data.path={presets['jsonl']}",
            f"data.tokenizer={presets['gemma']}",
            f"data.seq_len={SEQ_LEN}",
            "strategy=model_parallel",
            "mesh.model=8",
            "cluster.hosts=1",
            "cluster.devices_per_host=8",
            f"trainer.global_batch={BATCH}",
            "optimizer.learning_rate=0.01",
        ]
    )
    checked = preflight(cfg)
    assert counted_weight_reads == []
    trained = {v.path for v in checked.variables if v.trainable}
    assert trained and all("lora_kernel" in path for path in trained)
    try:
        model, dataset = build_on_grid(cfg, grid_of(1, 8))
        assert counted_weight_reads  # the hosts do read the preset's weights
        before = {v.path: np.asarray(v.value) for v in model.variables}
        x, y, weights = dataset.batch("train", 0, BATCH, slice(0, BATCH))
        for _ in range(2):  # LoRA's b starts at zero: a moves from the second step
            model.train_on_batch(x, y, weights)
        after = {v.path: np.asarray(v.value) for v in model.variables}
    finally:
        keras.distribution.set_distribution(None)
    changed = {path for path in before if not np.array_equal(before[path], after[path])}
    assert changed == trained


def test_init_from_an_earlier_export_starts_from_its_weights(tmp_path):
    """model.init_from with a model exported as a run exports it: the first loss is the
    exported model's own in plain Keras, on the same batch."""
    from training.checkpoint.export import export_model

    keras.distribution.set_distribution(None)
    earlier_cfg = run_config(["trainer.global_batch=32"])
    dataset = build_dataset(earlier_cfg.data)
    earlier = build_compiled(earlier_cfg, dataset.spec)
    x, y = dataset.batch("train", 0, 32, slice(0, 32))
    for _ in range(3):
        earlier.train_on_batch(x, y)
    exported = export_model(earlier, str(tmp_path / "model.keras"))

    cfg = run_config(["trainer.global_batch=32", f"model.init_from={exported}"])
    preflight(cfg)
    started = build_compiled(cfg, dataset.spec)
    x, y = dataset.batch("train", 1, 32, slice(0, 32))
    plain = keras.saving.load_model(exported)
    expected = plain.test_on_batch(x, y, return_dict=True)["loss"]
    assert started.test_on_batch(x, y, return_dict=True)["loss"] == pytest.approx(expected)
    fresh = build_compiled(run_config(["trainer.global_batch=32"]), dataset.spec)
    assert fresh.test_on_batch(x, y, return_dict=True)["loss"] != pytest.approx(expected)


@pytest.fixture(scope="module")
def other_mlp_weights(tmp_path_factory):
    """Weights of a wider MLP than the default's."""
    keras.distribution.set_distribution(None)
    cfg = run_config(["model.kwargs.hidden=128"])
    path = tmp_path_factory.mktemp("weights") / "wider.weights.h5"
    build_compiled(cfg, build_dataset(cfg.data).spec).save_weights(str(path))
    return path


def bad_input_cases():
    return [
        (["model=hub", "model.preset={tmp}/nowhere"], r"model.preset=.*nowhere.* cannot be"),
        (
            ["model=hub", "model.preset={no_tokenizer}", "data=jsonl", "data.path={jsonl}"],
            r"data=jsonl tokenizes with the preset .*bare.*, which has no CausalLM tokenizer",
        ),
        (
            ["model=keras", "model.build=a:b", "model.loss=mse", "data=jsonl", "data.path={jsonl}"],
            r"data=jsonl needs a tokenizer",
        ),
        (
            [
                "model=hub",
                "model.preset={gemma}",
                "data=jsonl",
                "data.path={jsonl}",
                "data.field=body",
            ],
            r"has no text field 'body' \(its fields: \['prompt', 'response', 'text'\]\)",
        ),
        (
            ["model=hub", "model.preset={gemma}", "model.lora_rank=4", "model.lora_targets=[qkv]"],
            r"model.lora_targets=\['qkv'\] names no layer .* that takes LoRA.*query",
        ),
        (["model=hub", "export.lora_only=true"], r"export.lora_only .* model.lora_rank"),
        (["model.init_from={tmp}/missing.keras"], r"model.init_from=.*missing.keras.* does not"),
        (
            ["model.init_from={wider}"],
            r"model.init_from=.*wider.weights.h5.* does not fit the model: .*"
            r"block_0_up/kernel has shape \(64, 256\), the stored value \(64, 128\); not loaded: "
            r"block_0_up, block_0_down, block_1_up and 1 more",
        ),
    ]


@pytest.mark.parametrize("overrides,message", bad_input_cases())
def test_bad_fine_tuning_input_is_one_config_error(
    presets, other_mlp_weights, tmp_path, overrides, message
):
    paths = {
        "tmp": tmp_path,
        "wider": other_mlp_weights,
        **{name: path for name, path in presets.items()},
    }
    keras.distribution.set_distribution(None)
    with pytest.raises(ConfigError, match=message):
        preflight(run_config([o.format(**paths) for o in overrides]))


def test_an_auto_layout_of_a_lora_model_splits_the_frozen_weights_too(presets):
    """LoRA freezes the base weights, which still fill each device: the automatic layout
    splits them over `model` as without LoRA."""
    from training.models import rule_axes

    def derived(lora_rank: int) -> dict:
        cfg = run_config(
            preset_overrides(
                presets,
                "gemma",
                f"model.lora_rank={lora_rank}",
                "strategy=hybrid",
                "mesh.data=2",
                "mesh.model=4",
                "strategy.layout=auto",
            )
        )
        checked = preflight(cfg)
        return {v.path: rule_axes(v.path, checked.layout.rules) for v in checked.variables}

    with_lora, without = derived(4), derived(0)
    kernel = "decoder_block_0/attention/query/kernel"
    assert "model" in with_lora[kernel]
    assert {p: a for p, a in with_lora.items() if "lora" not in p} == without


@pytest.mark.slow
def test_lora_only_export_is_keras_hubs_lora_weights(presets, tmp_path):
    """export.lora_only writes what keras-hub's `load_lora_weights` reads back: the preset
    with those LoRA weights gives the trained model's logits."""
    import keras_hub

    from training.checkpoint.export import export_model

    keras.distribution.set_distribution(None)
    cfg = run_config(preset_overrides(presets, "gemma", "model.lora_rank=4"))
    dataset = build_dataset(cfg.data)
    model = build_compiled(cfg, dataset.spec)
    x, y, weights = dataset.batch("train", 0, BATCH, slice(0, BATCH))
    for _ in range(2):
        model.train_on_batch(x, y, weights)
    path = export_model(model, str(tmp_path / "model.lora.h5"), lora_only=True)
    assert path.endswith(".lora.h5")
    reloaded = keras_hub.models.CausalLM.from_preset(str(presets["gemma"]), preprocessor=None)
    reloaded.backbone.enable_lora(rank=4)
    reloaded.backbone.load_lora_weights(path)
    np.testing.assert_allclose(reloaded(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_init_from_then_lora_trains_lora_from_the_loaded_weights(presets, tmp_path):
    """Loading zeroes a LoRA layer's matrices; the run keeps LoRA's start, so it trains."""
    keras.distribution.set_distribution(None)
    base_cfg = run_config(preset_overrides(presets, "gemma"))
    dataset = build_dataset(base_cfg.data)
    base = build_compiled(base_cfg, dataset.spec)
    x, y, weights = dataset.batch("train", 0, BATCH, slice(0, BATCH))
    base.train_on_batch(x, y, weights)
    saved = str(tmp_path / "base.weights.h5")
    base.save_weights(saved)
    cfg = run_config(
        preset_overrides(presets, "gemma", "model.lora_rank=4", f"model.init_from={saved}")
    )
    model = build_compiled(cfg, dataset.spec)
    frozen = {v.path: np.asarray(v.value) for v in model.weights if "lora" not in v.path}
    assert all(np.array_equal(frozen[v.path], np.asarray(v.value)) for v in base.weights)
    before = {v.path: np.asarray(v.value) for v in model.trainable_weights}
    for _ in range(2):
        model.train_on_batch(x, y, weights)
    moved = {v.path for v in model.trainable_weights if not np.array_equal(before[v.path], v.value)}
    assert moved == set(before) and moved


# In a fresh process, as a user would: the preset opened by plain keras-hub (the package
# imported for Keras' backend only), its logits on the saved batch against the trained
# model's, then `python -m training.generate`'s sampling.
OPEN_AND_SAMPLE = """
import contextlib, io, json, sys
import training
import keras_hub
import numpy as np
from training import generate

opened = {}
for preset in sys.argv[1:]:
    batch = np.load(preset + ".npz")
    model = keras_hub.models.CausalLM.from_preset(preset)
    inputs = {"token_ids": batch["token_ids"], "padding_mask": batch["padding_mask"]}
    logits = np.asarray(model(inputs))
    sampled = io.StringIO()
    with contextlib.redirect_stdout(sampled):
        assert generate.main([preset, "the fox", "--max-length", "8"]) == 0
    scale = np.max(np.abs(batch["logits"]))
    error = float(np.max(np.abs(logits - batch["logits"])) / scale)
    opened[preset] = {"error": error, "sampled": sampled.getvalue()}
print(json.dumps(opened))
"""


def fine_tune_in_bfloat16(presets, param_dtype: str, preset: str) -> dict:
    """A LoRA fine-tune of the Gemma preset computing in bfloat16 under hybrid 2 × 4, with
    `trainer.param_dtype`, exported to `preset`: its variables' dtypes, its losses, and how far
    training moved its logits on the batch saved beside the preset (with those logits)."""
    from training.checkpoint.export import export_model

    cfg = run_config(
        preset_overrides(
            presets,
            "gemma",
            "model.lora_rank=4",
            "strategy=hybrid",
            "mesh.data=2",
            "mesh.model=4",
            "optimizer.learning_rate=0.02",
            "trainer.precision=bfloat16",
            f"trainer.param_dtype={param_dtype}",
        )
    )
    try:
        model, dataset = build_on_grid(cfg, grid_of(2, 4))
        x, y, weights = dataset.batch("train", 0, BATCH, slice(0, BATCH))
        before = np.asarray(model(x), np.float32)
        losses = [model.train_on_batch(x, y, weights, return_dict=True)["loss"] for _ in range(3)]
        logits = np.asarray(model(x), np.float32)
        export_model(model, preset)
    finally:
        keras.distribution.set_distribution(None)
        keras.config.set_dtype_policy("float32")
    np.savez(f"{preset}.npz", **x, logits=logits)
    lora = model.trainable_variables + [v for v in model.optimizer.variables if "lora" in v.path]
    return {
        "trained": {str(v.value.dtype) for v in lora},
        "frozen": {str(v.value.dtype) for v in model.non_trainable_variables if "kernel" in v.path},
        "losses": losses,
        "moved": np.max(np.abs(logits - before)) / np.max(np.abs(logits)),
    }


@pytest.mark.slow
def test_a_bfloat16_lora_fine_tune_exports_a_preset_that_plain_keras_hub_opens(presets, tmp_path):
    """trainer.precision=bfloat16 with LoRA, the base weights in float32 (Keras' mixed
    policy) or in bfloat16 (trainer.param_dtype; LoRA's matrices and their optimizer state
    stay float32, as Keras makes them): the loss falls, and each exported preset opens in a
    fresh process with plain keras-hub, gives the trained model's logits and samples with
    training.generate."""
    runs = {
        str(tmp_path / param_dtype): fine_tune_in_bfloat16(
            presets, param_dtype, str(tmp_path / param_dtype)
        )
        for param_dtype in ("float32", "bfloat16")
    }
    opened = run_plain_python(OPEN_AND_SAMPLE, *runs)
    for (preset, run), param_dtype in zip(runs.items(), ("float32", "bfloat16"), strict=True):
        assert run["trained"] == {"float32"} and run["frozen"] == {param_dtype}
        assert run["losses"][-1] < run["losses"][0], run["losses"]
        assert opened[preset]["sampled"].startswith("the fox")
        # Within bfloat16's rounding of the trained model's logits; training moved them more.
        assert opened[preset]["error"] < 0.02 and run["moved"] > 0.1
