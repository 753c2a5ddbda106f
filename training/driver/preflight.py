"""Checks run on the driver before any host trains: bad input fails here, cheaply and clearly
(while the hosts' actors start: see `training.run.run_training`)."""

from __future__ import annotations

from training import models
from training.build import count_parameters
from training.checkpoint.inspection import inspect_checkpoints
from training.config import ConfigError, RunConfig, TrainerConfig
from training.config.trainer import ALL_HELD_OUT
from training.contracts import DataSpec
from training.data import build_dataset
from training.driver.checked import Checked, check_sizes
from training.events import OutOfDeviceMemory
from training.models.flops import model_flops_per_example
from training.parallel.dtypes import readable_bytes
from training.parallel.mesh import MeshShape
from training.parallel.strategy import Strategy
from training.planning import costs
from training.planning.abstract import ModelKey, abstract_keras_model
from training.planning.advice import ways_to_hold_less, what_fits
from training.planning.compiled import compile_ahead_of_time
from training.planning.layout import resolve_layout
from training.planning.target import compiles_here
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
    model_key = ModelKey.of(cfg, data_spec)
    model = abstract_keras_model(model_key)
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
    strategy = Strategy.of(cfg.strategy)
    layout = resolve_layout(strategy, mesh, model_key)
    if cfg.plan.check_memory:
        check_memory_fits(cfg, costs.abstract_model(cfg, data_spec), mesh, per_host, compiled)
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
        layout.derived,
        None if strategy.replicates else layout.rules,
        count_parameters(model),
        model_flops_per_example(model, data_spec.positions_per_example),
        (*layout.warnings, *(w for w in [costs.untraced_warning(model)] if w)),
    )


def check_memory_fits(
    cfg: RunConfig,
    model: costs.AbstractModel,
    mesh: MeshShape,
    per_host: int,
    compiled: CompiledMemory | None = None,
) -> None:
    """The memory per device for the configured strategy (compiled, or the plan's estimate)
    within plan.device_memory_gb. Where the estimate says it does not fit and this process
    compiles the hosts' step (a TPU slice's by libtpu, a host in this process, CPU hosts),
    the compiler decides, and names what fits instead (a minute for a large model: only
    where the estimate would refuse the run)."""
    why = costs.over_budget(cfg, model, mesh, per_host, compiled)
    if why and compiled is None and compiles_here(cfg, mesh):
        try:
            compiled = compile_ahead_of_time(cfg, mesh).memory
        except OutOfDeviceMemory as refused:
            raise ConfigError(f"{refused}. {what_fits(cfg, mesh, refused.limit)}") from None
        budget = cfg.plan.device_memory_gb * 1e9
        advised = None if compiled.needed <= budget else what_fits(cfg, mesh, budget)
        why = advised and costs.over_budget(cfg, model, mesh, per_host, compiled, advised)
    if why:
        raise ConfigError(
            f"{why}. python -m training.plan shows each strategy's figures; "
            "plan.check_memory=false tries anyway"
        )


def explain_out_of_memory(cfg: RunConfig, checked: Checked, oom: OutOfDeviceMemory) -> str:
    """`oom` (a host's step that does not fit its devices) and the changes that fit them:
    each compiled ahead of time where this process compiles the hosts' step (a run in one
    process, CPU hosts), else by the plan's estimate scaled by how far the compiler's
    figure for this step is from it."""
    if oom.limit is None:
        return f"{oom}; trainer.remat, strategy=fsdp or a smaller micro-batch hold less"
    if compiles_here(cfg, checked.mesh):
        return f"{oom}. {what_fits(cfg, checked.mesh, oom.limit)}"
    spec, mesh = checked.data_spec, checked.mesh
    model = costs.abstract_model(cfg, spec)
    planned = _planned_bytes(cfg, model, mesh)
    scale = oom.needed / planned if oom.needed else 1.0
    fits = []
    for override, variant in ways_to_hold_less(cfg, mesh):
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
    strategy = Strategy.of(cfg.strategy)
    return costs.memory_cost(cfg, model, strategy, mesh, cfg.trainer.micro_batch).total_bytes


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
