"""keras-hub's causal LMs with their attention through the fused kernels
(training/models/hub_attention.py): on the CPU through Pallas' interpreter, the loss and every
gradient equal those of the same model with keras-hub's own attention, with padding and
grouped-query attention, for each architecture; an exported preset is keras-hub's own."""

import jax
import keras
import numpy as np
import pytest

from tests.models.test_attention import compiled_on_a_tpu
from training.models import hub, hub_attention

# Pallas' interpreter over six architectures: the full suite's.
pytestmark = pytest.mark.slow

SEQ, BATCH, VOCABULARY = 128, 2, 64
PADDED = 28  # the second example's first tokens are padding (on the left, so that a causal
# mask alone would let its real tokens see them)
GQA = dict(num_query_heads=4, num_key_value_heads=2, hidden_dim=64, intermediate_dim=64)
FAMILIES = {
    "llama": ("LlamaBackbone", GQA),
    "llama3": ("Llama3Backbone", GQA),
    # A sliding window shorter than the sequence.
    "mistral": ("MistralBackbone", {**GQA, "sliding_window": 48}),
    "qwen": ("QwenBackbone", GQA),
    "qwen3": ("Qwen3Backbone", {**GQA, "head_dim": 16}),
    # Soft-capped logits, a sliding window. (keras-hub 0.32's Gemma decoder gives its
    # attention query_head_dim_normalize=True whatever the backbone's.)
    "gemma": (
        "GemmaBackbone",
        {
            **GQA,
            "head_dim": 8,
            "attention_logit_soft_cap": 2.0,
            "use_sliding_window_attention": True,
            "sliding_window_size": 80,
        },
    ),
}


def tiny_task(family: str):
    backbone, sizes = FAMILIES[family]
    keras.utils.set_random_seed(3)
    model = hub.causal_lm(
        backbone, attention="keras_hub", vocabulary_size=VOCABULARY, num_layers=2, **sizes
    )
    model(batch()[0])
    return model


def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCABULARY, (BATCH, SEQ + 1)).astype("int32")
    padding = np.ones((BATCH, SEQ), "int32")
    padding[1, :PADDED] = 0
    inputs = {"token_ids": tokens[:, :-1], "padding_mask": padding}
    return inputs, tokens[:, 1:], padding.astype("float32")


def loss_and_gradients(model, data=None):
    """((loss, gradients), the step's jaxpr) on `data` (x, y, sample weights), else `batch()`."""
    inputs, labels, weights = data or batch()
    loss = hub.loss()
    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def value(trainable):
        logits, _ = model.stateless_call(trainable, fixed, inputs)
        return loss(labels, logits, sample_weight=weights)

    traced = jax.jit(jax.value_and_grad(value)).trace(trainable)
    return traced.lower().compile()(trainable), str(traced.jaxpr)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kernel_gives_keras_hubs_loss_and_gradients(family):
    model = tiny_task(family)
    (want_loss, want_grads), own = loss_and_gradients(model)
    hub_attention.install(model.task, "fused")
    (got_loss, got_grads), fused = loss_and_gradients(model)

    assert "pallas_call" in fused and "pallas_call" not in own
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for variable, got, want in zip(model.trainable_variables, got_grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=variable.path)


def test_on_a_tpu_the_compiled_step_holds_the_kernel_and_not_the_scores():
    """A keras-hub Llama (grouped-query attention, LoRA) built as a run builds it."""
    step = compiled_on_a_tpu("hub")
    assert step["tpu_custom_calls"] > 0
    assert step["scores"] == [], step["scores"]


def test_an_exported_preset_is_keras_hubs_own_and_computes_the_same(tmp_path):
    import keras_hub

    model = tiny_task("llama")
    hub_attention.install(model.task, "fused")
    model.save_to_preset(str(tmp_path))
    loaded = keras_hub.models.CausalLM.from_preset(str(tmp_path))
    assert type(loaded) is type(model.task)
    inputs, _, real = batch()
    # Equal where the tokens are real (at padding the fused kernel attends other padding).
    got, want = model.task(inputs), loaded(inputs)
    np.testing.assert_allclose(got * real[..., None], want * real[..., None], atol=2e-6)


def test_cached_generation_keeps_keras_hubs_attention():
    """One token against a cache of the sequence: keras-hub's own attention, not the kernel."""
    model = tiny_task("llama")
    hub_attention.install(model.task, "fused")
    backbone = model.task.backbone
    heads = GQA["hidden_dim"] // GQA["num_query_heads"]
    cache = np.zeros((BATCH, 2, 2, SEQ, GQA["num_key_value_heads"], heads), "float32")
    token = np.zeros((BATCH, 1), "int32")
    traced = jax.make_jaxpr(lambda c: model.task.call_with_cache(token, c, 0))(cache)
    assert backbone.num_layers == 2 and "pallas_call" not in str(traced)
