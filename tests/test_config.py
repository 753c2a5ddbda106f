"""Composition of every config group option, and typed rejection of bad values."""

import dataclasses

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from tests.conftest import CONF_DIR, compose_config, run_config
from training.config import (
    SCHEMAS,
    AdamConfig,
    ConfigError,
    LocalClusterConfig,
    ModelConfig,
    RayClusterConfig,
    SGDConfig,
)

GROUP_OPTIONS = sorted((path.parent.name, path.stem) for path in CONF_DIR.glob("*/*.yaml"))
# What an option needs that it cannot have a default for.
REQUIRED = {
    ("model", "keras"): ["model.build=my_models:get_model", "model.loss=mse"],
    ("data", "arrays"): ["data.path=train.npz"],
    ("data", "tokens"): ["data.path=train.bin"],
    ("data", "jsonl"): ["data.path=train.jsonl", "data.tokenizer=/presets/gemma"],
    ("data", "parquet"): ["data.path=train.parquet"],
    ("tracking", "mlflow"): ["tracking.uri=http://127.0.0.1:5000"],
}


def test_every_group_has_options():
    groups = {group for group, _ in GROUP_OPTIONS}
    assert {"strategy", "mesh", "model", "data", "optimizer", "cluster", "trainer"} <= groups


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_option_composes_into_its_own_schema(group, option):
    """Each option's node is its schema's dataclass, and names itself: `optimizer=adamw`
    is an AdamWConfig named adamw, not an Adam with another name."""
    cfg = run_config([f"{group}={option}", *REQUIRED.get((group, option), [])])
    node = getattr(cfg, group)
    schemas = SCHEMAS[group]
    if option in schemas:
        assert type(node) is schemas[option]
    else:  # an option of a shared schema (model=mlp is a keras model)
        assert type(node) in schemas.values()
    if dataclasses.fields(node)[0].name == "name":
        assert node.name == option


@pytest.mark.parametrize("key", ["model.build", "model.loss"])
def test_a_value_without_default_must_be_given(key):
    given = [o for o in REQUIRED[("model", "keras")] if not o.startswith(key)]
    with pytest.raises(ConfigError, match=f"{key} has no default: give it on the command line"):
        run_config(["model=keras", *given])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.build=my_models", "model.build='my_models' must name a Python object as"),
        ("model.loss=my-losses:huber", "model.loss='my-losses:huber' must name"),
        ("model.layout=layouts.get", "model.layout='layouts.get' must name"),
    ],
)
def test_object_paths_are_module_colon_function(override, message):
    overrides = [*REQUIRED[("model", "keras")], override]
    with pytest.raises(ConfigError, match=message):
        run_config(["model=keras", *overrides])


def test_defaults_are_data_parallel_on_two_local_hosts_of_four_devices():
    cfg = run_config([])
    assert cfg.strategy.name == "data_parallel"
    assert isinstance(cfg.cluster, LocalClusterConfig)
    # The tests hide any GPU (conftest), so the local cluster simulates CPU hosts.
    assert (cfg.cluster.platform, cfg.cluster.hosts, cfg.cluster.devices_per_host) == ("cpu", 2, 4)
    assert (cfg.mesh.data, cfg.mesh.model) == (-1, -1)
    assert isinstance(cfg.model, ModelConfig) and isinstance(cfg.optimizer, AdamConfig)
    assert cfg.model.build == "training.models.mlp:build"


def test_options_get_their_own_schema():
    assert isinstance(run_config(["optimizer=sgd"]).optimizer, SGDConfig)
    ray_cfg = run_config(["cluster=ray", "cluster.address=ray://head:10001"])
    assert isinstance(ray_cfg.cluster, RayClusterConfig)
    assert ray_cfg.cluster.address == "ray://head:10001"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.steps=many", "trainer.steps"),
        ("mesh.model=four", "mesh.model"),
        ("model.no_such_key=1", "model.no_such_key"),
        ("trainer.learning_rate=0.1", "trainer.learning_rate"),
    ],
)
def test_wrong_type_or_unknown_key_is_a_clear_error(override, message):
    with pytest.raises(ConfigCompositionException, match=message.replace(".", r"\.")):
        compose_config([override])


@pytest.mark.parametrize("group", ["strategy", "model", "data"])
def test_unknown_choice_lists_the_available_ones(group):
    with pytest.raises(MissingConfigException, match=f"Available options in '{group}'"):
        compose_config([f"{group}=no_such_option"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.steps=0", "trainer.steps must be >= 1"),
        ("mesh.data=0", "mesh.data=0"),
        ("cluster.hosts=0", "cluster.hosts=0: use a positive number, or -1 to derive it"),
        ("strategy.name=pipeline", "strategy.name='pipeline' is not one of"),
        ("trainer.param_dtype=float16", "trainer.param_dtype='float16' is not one of"),
        ("trainer.param_dtype=bfloat16", "trainer.param_dtype=bfloat16 needs trainer.precision"),
    ],
)
def test_out_of_range_values_are_rejected_at_the_boundary(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_config([override])


@pytest.mark.parametrize("given", ["model.kwargs.hidden=512", "model.kwargs={hidden: 512}"])
def test_a_build_functions_arguments_are_given_as_the_readme_writes_them(given):
    from training.config import compose_run_config

    own = compose_run_config(["model=keras", "model.build=mine:get", "model.loss=mse", given])
    assert own.model.kwargs == {"hidden": 512}
    builtin = compose_run_config([given])  # the MLP's other sizes stay as they were
    assert builtin.model.kwargs["hidden"] == 512 and builtin.model.kwargs["d_model"] == 64


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.data=2", "strategy=auto picks the mesh as well: drop mesh.data and mesh.model"),
        ("strategy.fsdp=true", "strategy=auto tries strategy=fsdp itself"),
    ],
)
def test_strategy_auto_leaves_the_mesh_and_fsdp_to_its_choice(override, message):
    with pytest.raises(ConfigError, match=message):
        run_config(["strategy=auto", override])
