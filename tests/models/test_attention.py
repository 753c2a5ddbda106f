"""The transformer's attention per platform: which kernel runs where; the TPU's Pallas kernel
(interpreted on the CPU) under the Keras distribution's (2, 4) mesh gives JAX's own
attention's outputs and gradients with nothing sent between devices, and trains as the einsum
path does; on a TPU the compiled step holds the kernel and not the scores."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from tests.models.test_transformer import TINY, train_in_process
from training.config import StrategyConfig
from training.models.attention import causal_attention, choose
from training.models.transformer import CausalSelfAttention
from training.parallel.mesh import MeshShape, build_distribution, device_grid
from training.parallel.strategy import Strategy
from training.planning import collectives

BF16, F32 = "bfloat16", "float32"


@pytest.mark.parametrize(
    ("implementation", "platform", "dtype", "seq", "head_dim", "kernel"),
    [
        ("auto", "tpu", BF16, 1024, 64, "splash"),
        ("auto", "tpu", F32, 256, 64, "splash"),
        ("auto", "tpu", BF16, 1000, 64, "einsum"),  # the kernel's tiles are 128 long
        ("auto", "gpu", BF16, 1024, 64, "cudnn"),
        ("auto", "gpu", "float16", 1000, 128, "cudnn"),
        ("auto", "gpu", F32, 1024, 64, "einsum"),
        ("auto", "gpu", BF16, 1024, 256, "einsum"),
        ("auto", "cpu", BF16, 1024, 64, "einsum"),
        ("einsum", "tpu", BF16, 1024, 64, "einsum"),
        ("einsum", "gpu", BF16, 1024, 64, "einsum"),
        ("fused", "tpu", BF16, 1024, 64, "splash"),
        ("fused", "cpu", F32, 128, 8, "splash"),
    ],
)
def test_each_platform_gets_its_kernel(implementation, platform, dtype, seq, head_dim, kernel):
    choice = choose(implementation, platform, dtype, seq, head_dim)
    assert choice.kernel == kernel
    assert choice.interpret == (platform == "cpu" and kernel == "splash")
    assert bool(choice.reason) == (kernel == "einsum")


@pytest.mark.parametrize(
    ("platform", "dtype", "seq", "why"),
    [
        ("gpu", F32, 1024, "bfloat16 or float16, not float32"),
        ("tpu", BF16, 1000, "multiple of 128, not 1000"),
        ("cpu", F32, 16, "multiple of 128, not 16"),
    ],
)
def test_fused_says_why_the_kernel_does_not_take_the_inputs(platform, dtype, seq, why):
    with pytest.raises(ValueError, match=why):
        choose("fused", platform, dtype, seq, 64)


def test_an_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="attention='flash' is not one of auto, einsum, fused"):
        choose("flash", "tpu", BF16, 1024, 64)


def test_the_layer_config_keeps_the_implementation():
    layer = CausalSelfAttention(4, 8, attention="einsum", name="a")
    assert CausalSelfAttention.from_config(layer.get_config()).attention == "einsum"
    assert CausalSelfAttention.from_config(CausalSelfAttention(4, 8).get_config()).attention == (
        "auto"
    )


def jax_attention(query, key, value):
    """JAX's own reference implementation, independent of the code under test."""
    return jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="xla")


def test_the_kernel_on_each_device_of_a_2x4_mesh_gives_jaxs_attention_and_sends_nothing():
    hybrid = Strategy.of(StrategyConfig(name="hybrid"))
    distribution = build_distribution(hybrid, device_grid(jax.devices(), MeshShape(2, 4)), {})
    heads_split = NamedSharding(
        distribution.device_mesh.backend_mesh, PartitionSpec("data", None, "model", None)
    )
    keys = jax.random.split(jax.random.key(0), 4)
    # (batch, seq, heads, head_dim), laid out as the transformer's rules lay them out.
    q, k, v, cotangent = (
        jax.device_put(jax.random.normal(key, (2, 128, 4, 8)), heads_split) for key in keys
    )

    def loss_and_grads(attention):
        loss = lambda q, k, v: jnp.sum(attention(q, k, v) * cotangent)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    fused = lambda q, k, v: causal_attention(q, k, v, "fused")  # noqa: E731
    with distribution.scope():
        traced = str(jax.make_jaxpr(fused)(q, k, v))
        got = loss_and_grads(fused)(q, k, v)
        hlo = jax.jit(fused).lower(q, k, v).compile().as_text()
    want = loss_and_grads(jax_attention)(q, k, v)

    assert "shard_map" in traced and "pallas_call" in traced
    assert collectives.from_hlo(hlo, 8) == []
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(got_grad, want_grad, atol=1e-5)
        assert got_grad.sharding.spec == heads_split.spec


@pytest.mark.slow
def test_the_kernel_trains_as_the_einsum_path_does():
    """The transformer under hybrid 2 × 4, its attention through the Pallas kernel (run by
    JAX's interpreter on the CPU) or the einsum path: the same losses."""
    run = [*TINY, "model.seq_len=128", "trainer.global_batch=4"]
    einsum = train_in_process("hybrid", MeshShape(2, 4), [*run, "model.kwargs.attention=einsum"])
    fused = train_in_process("hybrid", MeshShape(2, 4), [*run, "model.kwargs.attention=fused"])
    np.testing.assert_allclose([r.loss for r in fused], [r.loss for r in einsum], rtol=1e-5)
    assert fused[-1].held_out["loss"] == pytest.approx(einsum[-1].held_out["loss"], rel=1e-5)


def compiled_on_a_tpu(model: str) -> dict:
    """tpu_attention_step's report of `model`'s compiled step; skips without a TPU."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs a TPU")
    # The tests' own process keeps to the CPU (conftest.py): the step compiles in another,
    # without the CPU's platform and flags.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    found = subprocess.run(
        [sys.executable, "-m", "tests.models.tpu_attention_step", model],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    step = json.loads(found.stdout.splitlines()[-1])
    if step["platform"] != "tpu":
        pytest.skip(f"libtpu is installed but JAX found no TPU ({step['platform']})")
    return step


@pytest.mark.slow
def test_on_a_tpu_the_compiled_step_holds_the_kernel_and_not_the_scores():
    step = compiled_on_a_tpu("transformer")
    assert step["tpu_custom_calls"] > 0
    assert step["scores"] == [], step["scores"]
