"""Checks run on the driver before any host trains: bad input fails here, cheaply and clearly
(while the hosts' actors start: see `training.run.run_training`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

from training import models
from training.build import count_parameters
from training.checkpoint.inspection import inspect_checkpoints
from training.config import ConfigError, RunConfig, TrainerConfig
from training.config.trainer import ALL_HELD_OUT
from training.contracts import ACTIVATION_RULE_SUFFIX, DataSpec, LayoutRules, VariableInfo
from training.data import build_dataset
from training.driver.checked import Checked, check_sizes
from training.events import OutOfDeviceMemory
from training.models.flops import model_flops_per_example
from training.models.remat import rematerialised
from training.parallel import fsdp
from training.parallel.dtypes import readable_bytes
from training.parallel.mesh import MeshShape
from training.planning import auto_layout, costs, tensor_parallel
from training.recipe import compile_model
from training.recipe.metrics import check_held_out_figure, check_metrics_fit
from training.recipe.optimizer import check_updates_weights_of
from training.step import CompiledMemory


def preflight(cfg: RunConfig, compiled: CompiledMemory | None = None) -> Checked:
    """The checks; the memory check by the `compiled` step's figure where the driver compiled
    it (strategy=auto), else by the plan's estimate."""
    hosts, per_host = cfg.cluster.hosts, cfg.cluster.devices_per_host
    mesh = check_sizes(cfg)
    dataset = build_dataset(cfg.data)
    data_spec = dataset.spec
    check_enough_examples(cfg.trainer, data_spec)
    with models.dtype_policy(cfg.trainer.dtype_policy):
        model = rematerialised(
            lambda: models.abstract_model(cfg.model, data_spec), cfg.trainer.remat, data_spec
        )
    models.check_labels_fit(cfg.model, model, data_spec)
    for dtype in {v.dtype for v in model.trainable_variables} - {"float32"}:
        check_updates_weights_of(cfg.optimizer, dtype)
    compile_model(model, cfg)
    figures = check_metrics_fit(
        cfg.model, model, data_spec, evaluates=cfg.trainer.eval_batches != 0
    )
    check_held_out_figure("checkpoint.keep_best", cfg.checkpoint.keep_best, figures)
    check_held_out_figure(
        "trainer.early_stopping.metric", cfg.trainer.early_stopping.metric, figures
    )
    variables = [models.variable_info(v) for v in model.variables]
    layout, rules = None, None
    if cfg.strategy.name == "fsdp":
        rules = fsdp.user_rules_only(cfg.strategy.layout_rules)
    elif auto_layout.uses_auto_layout(cfg):
        layout = auto_layout.derive(model, mesh.model, cfg.strategy.layout_rules)
        rules = layout.rules
    elif cfg.strategy.name != "data_parallel":
        paths = [v.path for v in variables]
        rules = models.layout_rules(
            cfg.model, mesh.as_tuple(), cfg.strategy.layout_rules, variables=paths
        )
    if rules is not None:
        check_layout_rules(rules, variables, mesh)
        rules = {**rules, **tensor_parallel.output_rules(model, rules, mesh.model)}
    if cfg.strategy.shards_over_data:
        rules = fsdp.shard_over_data(rules, variables, mesh.data)
    if cfg.plan.check_memory:
        model_cost = costs.abstract_model(cfg, data_spec, model)
        check_memory_fits(cfg, model_cost, mesh, per_host, compiled)
    resume_step = (
        inspect_checkpoints(cfg, variables, data_spec.fingerprint)
        if cfg.checkpoint.enabled
        else None
    )
    return Checked(
        mesh,
        hosts,
        per_host,
        tuple(variables),
        dataset,
        resume_step,
        layout,
        rules,
        count_parameters(model),
        model_flops_per_example(model, data_spec.positions_per_example),
        tuple(w for w in [costs.untraced_warning(model)] if w),
    )


def check_memory_fits(
    cfg: RunConfig,
    model: costs.AbstractModel,
    mesh: MeshShape,
    per_host: int,
    compiled: CompiledMemory | None = None,
) -> None:
    """The memory per device for the configured strategy (compiled, or the plan's estimate)
    within plan.device_memory_gb."""
    why = costs.over_budget(cfg, model, mesh, per_host, compiled)
    if why:
        raise ConfigError(
            f"{why}. python -m training.plan shows each strategy's figures; "
            "plan.check_memory=false tries anyway"
        )


def explain_out_of_memory(cfg: RunConfig, checked: Checked, oom: OutOfDeviceMemory) -> str:
    """`oom` (a host's step that does not fit its devices) and the changes that fit them by
    the plan, scaled by how far the compiler's figure for this step is from the plan's."""
    if oom.limit is None:
        return f"{oom}; trainer.remat, strategy=fsdp or a smaller micro-batch hold less"
    spec, mesh = checked.data_spec, checked.mesh
    model = costs.abstract_model(cfg, spec)
    planned = _planned_bytes(cfg, model, mesh)
    scale = oom.needed / planned if oom.needed else 1.0
    fits = []
    for override, variant in _ways_to_hold_less(cfg, mesh):
        same_model = variant.trainer.remat == cfg.trainer.remat
        needed = scale * _planned_bytes(
            variant, model if same_model else costs.abstract_model(variant, spec), mesh
        )
        if needed <= oom.limit:
            fits.append(f"{override} ({readable_bytes(needed)})")
    ways = (
        "these fit: " + ", ".join(fits)
        if fits
        else "none of trainer.remat, fsdp, trainer.accumulate or a halved trainer.global_batch "
        "fits: use more devices or a smaller model"
    )
    return (
        f"{oom}. By the plan (training.plan's memory), scaled by {scale:.2f} to the compiler's "
        f"figure for this step, {ways}"
    )


def _planned_bytes(cfg: RunConfig, model: costs.AbstractModel, mesh: MeshShape) -> int:
    strategy, examples = cfg.strategy.name, cfg.trainer.micro_batch
    return costs.memory_cost(cfg, model, strategy, mesh, examples).total_bytes


def _ways_to_hold_less(cfg: RunConfig, mesh: MeshShape) -> Iterator[tuple[str, RunConfig]]:
    """The changes of one setting that hold less per device: remat, fsdp, more
    micro-batches, half the batch; each as its override and the config it makes."""
    trainer, strategy = cfg.trainer, cfg.strategy
    for mode in ("dots", "full"):
        if trainer.remat not in (mode, "full"):
            yield f"trainer.remat={mode}", replace(cfg, trainer=replace(trainer, remat=mode))
    if strategy.name == "data_parallel" and mesh.data > 1:
        yield "strategy=fsdp", replace(cfg, strategy=replace(strategy, name="fsdp"))
    if strategy.name == "hybrid" and not strategy.fsdp:
        yield "strategy.fsdp=true", replace(cfg, strategy=replace(strategy, fsdp=True))
    batch = trainer.global_batch
    for accumulate in (2 * trainer.accumulate, 4 * trainer.accumulate):
        if batch % accumulate == 0 and (batch // accumulate) % mesh.data == 0:
            yield (
                f"trainer.accumulate={accumulate}",
                replace(cfg, trainer=replace(trainer, accumulate=accumulate)),
            )
    half = batch // 2
    if trainer.micro_batch % 2 == 0 and (trainer.micro_batch // 2) % mesh.data == 0:
        yield (
            f"trainer.global_batch={half}",
            replace(cfg, trainer=replace(trainer, global_batch=half)),
        )


def check_enough_examples(trainer: TrainerConfig, data_spec: DataSpec) -> None:
    if data_spec.examples < trainer.global_batch:
        raise ConfigError(
            f"the training data has {data_spec.examples} examples, fewer than one global batch "
            f"(trainer.global_batch={trainer.global_batch})"
        )
    if trainer.eval_batches == ALL_HELD_OUT and not data_spec.held_out_examples:
        raise ConfigError(
            "trainer.eval_batches=-1 evaluates the whole held-out set, but this data does not "
            "say how many held-out examples it has: give a number of batches"
        )


def check_layout_rules(rules: LayoutRules, variables: list[VariableInfo], mesh: MeshShape) -> None:
    """Every variable rule must match a variable, fit its rank and split its dimensions
    evenly (activation rules are left to Keras, which applies them while building)."""
    axis_sizes = {"data": mesh.data, "model": mesh.model, None: 1}
    rules = {p: a for p, a in rules.items() if not p.endswith(ACTIVATION_RULE_SUFFIX)}
    listing = "\n  ".join(f"{v.path} {list(v.shape)}" for v in variables)
    for pattern, axes in rules.items():
        matched = [v for v in variables if re.fullmatch(pattern, v.path)]
        if not matched:
            raise ConfigError(
                f"layout rule {pattern!r} matches no variable of the model (rules are "
                f"full-match regexes on variable paths). The model's variables:\n  {listing}"
            )
        for variable in matched:
            _check_split(pattern, axes, variable, axis_sizes)
    for variable in variables:
        hits = [p for p in rules if re.fullmatch(p, variable.path)]
        if len(hits) > 1:
            raise ConfigError(f"variable {variable.path} matches several layout rules: {hits}")


def _check_split(pattern: str, axes: tuple, variable: VariableInfo, axis_sizes: dict) -> None:
    if len(axes) != len(variable.shape):
        raise ConfigError(
            f"layout rule {pattern!r} gives {len(axes)} axes {axes} for {variable.path}, "
            f"which has {len(variable.shape)} dimensions {list(variable.shape)}"
        )
    for dim, (size, axis) in enumerate(zip(variable.shape, axes, strict=True)):
        if axis not in axis_sizes:
            raise ConfigError(f"layout rule {pattern!r} names unknown mesh axis {axis!r}")
        if size % axis_sizes[axis]:
            raise ConfigError(
                f"layout rule {pattern!r} splits dimension {dim} of {variable.path} "
                f"(size {size}, shape {list(variable.shape)}) over mesh.{axis}="
                f"{axis_sizes[axis]}, which does not divide it"
            )
