"""Strategy -> distribution on 8 in-process CPU devices: the live arrays carry the configured
partition specs, and the mesh keeps model groups inside hosts."""

import jax
import keras
import pytest

from tests.conftest import fake_devices, run_config
from training import models
from training.config import ConfigError, MeshConfig, StrategyConfig
from training.data import build_dataset
from training.parallel.mesh import (
    MeshShape,
    build_distribution,
    device_grid,
    host_batch_rows,
    model_groups_within_hosts,
    resolve_mesh,
)
from training.parallel.strategy import Strategy


@pytest.fixture
def built_model():
    """Build the configured model under its distribution, as a host does; undo afterwards."""

    def build(strategy: str, mesh: MeshShape, extra_rules=None):
        cfg = run_config([f"strategy={strategy}"])
        grid = device_grid(jax.devices(), mesh)
        rules = models.layout_rules(cfg.model, mesh.as_tuple(), extra_rules, grid)
        keras.distribution.set_distribution(
            build_distribution(Strategy.of(cfg.strategy), grid, rules)
        )
        keras.utils.set_random_seed(0)
        return models.build_model(cfg.model, build_dataset(cfg.data).spec), rules

    yield build
    keras.distribution.set_distribution(None)


# The MLP's Megatron split, written out: `up` by columns, `down` by rows, the rest replicated.
EXPECTED_MLP_SPECS = {
    "up/kernel": (None, "model"),
    "up/bias": ("model",),
    "down/kernel": ("model", None),
}


def spec_of(variable) -> tuple:
    return tuple(variable.value.sharding.spec)


@pytest.mark.parametrize("mesh", [MeshShape(2, 4), MeshShape(1, 8), MeshShape(4, 2)])
def test_model_parallel_variables_carry_the_configured_specs(built_model, mesh):
    model, _ = built_model("hybrid", mesh)
    sharded = 0
    for variable in model.variables:
        expected = EXPECTED_MLP_SPECS.get(variable.path.split("_", 2)[-1])
        expected = expected or (None,) * len(variable.shape)
        assert spec_of(variable) == tuple(expected), variable.path
        shard = variable.value.addressable_shards[0].data.shape
        for size, shard_size, axis in zip(variable.shape, shard, expected, strict=True):
            assert shard_size == size // (mesh.model if axis == "model" else 1), variable.path
        sharded += any(axis == "model" for axis in expected)
    assert sharded == 6  # up kernel, up bias and down kernel of both blocks


def test_data_parallel_replicates_every_variable(built_model):
    model, _ = built_model("data_parallel", MeshShape(8, 1))
    for variable in model.variables:
        assert all(axis is None for axis in spec_of(variable)), variable.path
        assert variable.value.addressable_shards[0].data.shape == variable.shape


def test_extra_rules_shard_what_the_model_leaves_replicated(built_model):
    model, _ = built_model("hybrid", MeshShape(2, 4), {"head/kernel": (None, "model")})
    head = next(v for v in model.variables if v.path == "head/kernel")
    assert spec_of(head) == (None, "model")


def test_rules_of_one_layout_are_one_key_of_keras_layout_map(built_model):
    """Keras full-matches every key of its LayoutMap against each path it looks up, through
    re's cache of 512 compiled patterns: fsdp's rule per weight overflows it on a large model
    (minutes of a 7 B plan). Rules with the same axes are one key, and each variable keeps
    its own rule's layout."""
    many = {f"unused_{i}/kernel": (None, "model") for i in range(600)}
    model, rules = built_model("hybrid", MeshShape(2, 4), {**many, "head/kernel": (None, "model")})
    layouts = {tuple(axes) for axes in rules.values()}
    assert len(keras.distribution.distribution()._layout_map) == len(layouts)
    head = next(v for v in model.variables if v.path == "head/kernel")
    assert spec_of(head) == (None, "model")
    for variable in model.variables:
        expected = EXPECTED_MLP_SPECS.get(variable.path.split("_", 2)[-1])
        if expected:
            assert spec_of(variable) == expected, variable.path


@pytest.mark.parametrize(
    ("mesh", "within"), [((2, 4), True), ((4, 2), True), ((8, 1), True), ((1, 8), False)]
)
def test_model_groups_stay_inside_hosts_when_they_fit(mesh, within):
    grid = device_grid(fake_devices(2, 4), MeshShape(*mesh))
    assert model_groups_within_hosts(grid) is within
    assert [d.process_index for d in grid.reshape(-1)] == [0] * 4 + [1] * 4


@pytest.mark.parametrize(
    ("mesh", "rows"),
    [
        ((2, 4), [slice(0, 32), slice(32, 64)]),
        ((4, 2), [slice(0, 32), slice(32, 64)]),
        ((8, 1), [slice(0, 32), slice(32, 64)]),
        ((1, 8), [slice(0, 64), slice(0, 64)]),  # one model spans both hosts: both feed all
    ],
)
def test_each_host_feeds_the_rows_its_devices_hold(mesh, rows):
    grid = device_grid(fake_devices(2, 4), MeshShape(*mesh))
    assert [host_batch_rows(grid, host, 64) for host in range(2)] == rows


def named(strategy: str) -> Strategy:
    return Strategy.of(StrategyConfig(name=strategy))


@pytest.mark.parametrize(
    ("strategy", "mesh", "expected"),
    [
        ("data_parallel", (-1, -1), (8, 1)),
        ("model_parallel", (-1, -1), (1, 8)),
        ("hybrid", (-1, -1), (2, 4)),
        ("hybrid", (4, -1), (4, 2)),
        ("hybrid", (-1, 8), (1, 8)),
        ("model_parallel", (-1, 8), (1, 8)),
    ],
)
def test_auto_axes_take_the_remaining_devices(strategy, mesh, expected):
    shape = resolve_mesh(named(strategy), MeshConfig(*mesh), hosts=2, devices_per_host=4)
    assert (shape.data, shape.model) == expected


@pytest.mark.parametrize(
    ("strategy", "mesh", "message"),
    [
        (
            "hybrid",
            (2, 2),
            r"mesh.data × mesh.model = 2 × 2 = 4 devices, but the cluster "
            r"provides 8 \(2 hosts × 4 devices\)",
        ),
        ("hybrid", (3, -1), r"mesh.data=3 does not divide the cluster's 8 devices"),
        ("data_parallel", (-1, 2), r"mesh.model must be 1"),
        ("model_parallel", (2, -1), r"mesh.data must be 1"),
    ],
)
def test_impossible_meshes_are_rejected(strategy, mesh, message):
    with pytest.raises(ConfigError, match=message):
        resolve_mesh(named(strategy), MeshConfig(*mesh), hosts=2, devices_per_host=4)
