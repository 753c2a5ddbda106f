"""Memory per device under each strategy, as XLA compiles the step, against the plan; what
fsdp sends against its minimum; what rematerialisation saves and costs; a model that does not
fit one device's budget. One process, 8 simulated CPU devices; every figure is a ratio of two
measurements made here (only the remat step time is timed, both runs in this process).

    python scripts/bench_memory.py [--quick]   # --quick: skips the plan-vs-compiled grid

1. fsdp (8 devices) and hybrid with fsdp (2 × 4): weights + optimizer state per device
   against (total ÷ 8) + the vectors left whole; bytes sent per step against the FSDP
   minimum: each split weight all-gathered once (kept for the backward pass), its gradient
   reduce-scattered, the rest all-reduced. XLA:CPU all-reduces the split weights' gradients
   and slices them; the figure counts that all-reduce as the reduce-scatter of the same
   payload that XLA:GPU's reduce-scatter creator makes of it.
2. trainer.remat=full and =dots on the transformer at model.seq_len=512: compiled temporaries
   and step time against trainer.remat=none.
3. plan ÷ compiled, per device: the state (weights, optimizer) against XLA's arguments, the
   whole (state, gradients, activations) against arguments + temporaries; the MLP, the
   transformer and the tiny Llama, under each strategy, without remat, with full and dots.
4. wide_mlp against a budget (plan.device_memory_gb) below its weights + optimizer state:
   the plan's verdict per strategy, and fsdp's compiled peak against the budget.
5. wide_mlp under fsdp (this process the one host): the most it held of its arrays while the
   model and its optimizer state were built, and while a checkpoint was restored, against
   its share of the state plus its largest variable.

    python scripts/bench_memory.py --accelerator [--workloads=transformer-86M,llama-lora]

6. (alone, with --accelerator) plan ÷ compiled on this machine's accelerator, one device:
   the built-in transformer at 86 M parameters and a keras-hub Llama of TinyLlama-1.1B's
   shape with LoRA (scripts/bench_accelerator.py's workloads), without remat, with dots and
   full: the plan's whole (state, gradients, activations) against what the hosts' own
   compiled step needs (training.host.memory), and whether each fits the device by the plan
   and by the compiler.
"""

from __future__ import annotations

import os
import sys

from training.models.remat import cpu_xla_flags

ON_ACCELERATOR = "--accelerator" in sys.argv
if not ON_ACCELERATOR:
    os.environ["XLA_FLAGS"] = cpu_xla_flags(8)
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["KERAS_BACKEND"] = "jax"

import time  # noqa: E402

import jax  # noqa: E402
import keras  # noqa: E402

from training.build import build_on_grid  # noqa: E402
from training.config import ConfigError, compose_run_config  # noqa: E402
from training.data import build_dataset  # noqa: E402
from training.models import rule_axes  # noqa: E402
from training.parallel.dtypes import array_bytes, readable_bytes  # noqa: E402
from training.parallel.mesh import MeshShape, device_grid  # noqa: E402
from training.planning.collectives import Collective, sent_bytes  # noqa: E402
from training.planning.compiled import (  # noqa: E402
    as_hosts_get_it,
    built_as_hosts_build,
    compiled_train_step,
    held_bytes,
    measure_step,
)
from training.planning.costs import (  # noqa: E402
    abstract_model,
    layout_rules,
    memory_cost,
    split_ways,
)

ONE_HOST = ["cluster.hosts=1", "cluster.devices_per_host=8"]
TRANSFORMER = ["model=transformer", "data=text", "trainer.global_batch=16"]
REMATS = ("none", "full", "dots")
MODELS = {
    "mlp": ["model=mlp", "trainer.global_batch=16"],
    "wide_mlp": ["model=wide_mlp", "trainer.global_batch=16"],
    "transformer": TRANSFORMER,
    "llama": ["model=hub", "data=text", "model.seq_len=32", "trainer.global_batch=16"],
}
STRATEGIES = {
    "data_parallel": ("data_parallel", MeshShape(8, 1), []),
    "fsdp": ("fsdp", MeshShape(8, 1), []),
    "hybrid": ("hybrid", MeshShape(2, 4), []),
    "hybrid+fsdp": ("hybrid", MeshShape(2, 4), ["strategy.fsdp=true"]),
    "model_parallel": ("model_parallel", MeshShape(1, 8), []),
}


def config(model: str, strategy: str, *extra: str):
    name, mesh, overrides = STRATEGIES[strategy]
    return compose_run_config(
        [*ONE_HOST, *MODELS[model], f"strategy={name}", f"mesh.data={mesh.data}"]
        + [f"mesh.model={mesh.model}", *overrides, *extra]
    ), mesh


def measured(cfg, mesh):
    try:
        return measure_step(cfg, mesh)
    finally:
        keras.distribution.set_distribution(None)


def fsdp_figures(model: str, strategy: str) -> None:
    cfg, mesh = config(model, strategy)
    plan_model = abstract_model(cfg, build_dataset(cfg.data).spec)
    rules = layout_rules(cfg, cfg.strategy.name, mesh, plan_model)
    step = measured(cfg, mesh)
    state = step.parameter_bytes_per_device + step.optimizer_bytes_per_device
    whole = [v for v in plan_model.variables if split_ways(v.path, rules, mesh) == 1]
    slots = [v for v, owner in plan_model.optimizer_variables if owner in {w.path for w in whole}]
    total = sum(array_bytes(v.shape, v.dtype) for v in plan_model.variables) + sum(
        array_bytes(v.shape, v.dtype) for v, _ in plan_model.optimizer_variables
    )
    left_whole = sum(array_bytes(v.shape, v.dtype) for v in [*whole, *slots])
    ideal = (total - left_whole) / mesh.devices + left_whole
    print(
        f"  {model} {strategy} {mesh.data}×{mesh.model}: weights + optimizer state per device "
        f"{readable_bytes(state)}, (total ÷ {mesh.devices}) + vectors whole "
        f"{readable_bytes(ideal)}: ratio {state / ideal:.3f}"
    )
    if mesh.model > 1:
        return
    split = [
        v
        for v in plan_model.variables
        if v.path in plan_model.trainable and "data" in rule_axes(v.path, rules)
    ]
    split_bytes = sum(array_bytes(v.shape, v.dtype) for v in split)
    replicated = sum(
        array_bytes(v.shape, v.dtype)
        for v in plan_model.variables
        if v.path in plan_model.trainable and v not in split
    )
    minimum = sent_bytes(
        [
            Collective("all-gather", split_bytes, mesh.data),
            Collective("reduce-scatter", split_bytes, mesh.data),
            Collective("all-reduce", replicated, mesh.data),
        ]
    )
    as_on_gpu = []
    for c in step.collectives:
        if c.kind == "all-reduce" and c.bytes >= split_bytes:  # the gradients, combined
            as_on_gpu += [
                Collective("reduce-scatter", split_bytes, c.group),
                Collective("all-reduce", c.bytes - split_bytes, c.group),
            ]
        else:
            as_on_gpu.append(c)
    kinds = sorted({c.kind for c in step.collectives})
    print(
        f"    sent per step {readable_bytes(sent_bytes(as_on_gpu))} (XLA:CPU's "
        f"{', '.join(kinds)}: {readable_bytes(step.sent_bytes)}), FSDP minimum "
        f"{readable_bytes(minimum)}: ratio {sent_bytes(as_on_gpu) / minimum:.3f}"
    )


def remat_figures() -> None:
    cfg_args = [*ONE_HOST, *TRANSFORMER, "model.seq_len=512", "strategy=data_parallel"]
    found = {}
    for remat in REMATS:
        cfg = compose_run_config([*cfg_args, f"trainer.remat={remat}"])
        model, dataset = build_on_grid(cfg, device_grid(jax.devices(), MeshShape(8, 1)))
        x, y = dataset.batch("train", 0, 16, slice(0, 16))
        temporaries = compiled_train_step(model, x, y).memory_analysis().temp_size_in_bytes
        model.train_on_batch(x, y)  # compiled
        start = time.perf_counter()
        for _ in range(5):
            loss = model.train_on_batch(x, y)
        jax.block_until_ready(loss)
        found[remat] = (temporaries, (time.perf_counter() - start) / 5)
        keras.distribution.set_distribution(None)
    t0, s0 = found["none"]
    for remat in REMATS[1:]:
        t1, s1 = found[remat]
        print(
            f"  transformer, model.seq_len=512, 8 devices, remat={remat}: temporaries "
            f"{readable_bytes(t1)} against {readable_bytes(t0)} without: ratio {t1 / t0:.3f}; "
            f"step {s1 * 1e3:.0f} ms against {s0 * 1e3:.0f} ms: ratio {s1 / s0:.3f}"
        )


def plan_against_compiled() -> None:
    print(f"  {'model':12} {'strategy':15} {'remat':5} {'state':>7} {'peak':>7}  plan peak")
    for model in ("mlp", "transformer", "llama"):
        for strategy in STRATEGIES:
            for remat in REMATS:
                cfg, mesh = config(model, strategy, f"trainer.remat={remat}")
                try:
                    plan_model = abstract_model(cfg, build_dataset(cfg.data).spec)
                    plan = memory_cost(cfg, plan_model, cfg.strategy.name, mesh, 16)
                    step = measured(cfg, mesh).memory
                except (ConfigError, ValueError) as error:
                    print(f"  {model:12} {strategy:15} {remat:5} -: {str(error)[:60]}")
                    continue
                print(
                    f"  {model:12} {strategy:15} {remat:5} {plan.state_bytes / step.arguments:7.2f}"
                    f" {plan.total_bytes / step.peak:7.2f}  {readable_bytes(plan.total_bytes)}"
                    f" (compiled {readable_bytes(step.peak)})"
                )


def budget_figures() -> None:
    budget_gb = 0.2
    cfg, mesh = config("wide_mlp", "data_parallel", f"plan.device_memory_gb={budget_gb}")
    plan_model = abstract_model(cfg, build_dataset(cfg.data).spec)
    state = sum(array_bytes(v.shape, v.dtype) for v in plan_model.variables) + sum(
        array_bytes(v.shape, v.dtype) for v, _ in plan_model.optimizer_variables
    )
    print(
        f"  wide_mlp: weights + optimizer state {readable_bytes(state)}, budget "
        f"plan.device_memory_gb={budget_gb}"
    )
    for strategy in ("data_parallel", "fsdp"):
        cfg, mesh = config("wide_mlp", strategy, f"plan.device_memory_gb={budget_gb}")
        plan = memory_cost(cfg, plan_model, cfg.strategy.name, mesh, 16)
        fits = plan.total_bytes <= budget_gb * 1e9
        line = f"    {strategy}: the plan says {readable_bytes(plan.total_bytes)} per device, "
        line += "fits" if fits else "does not fit"
        if fits:
            peak = measured(cfg, mesh).memory.peak
            line += f"; compiled peak {readable_bytes(peak)}: {peak / (budget_gb * 1e9):.2f} of it"
        print(line)


def live_bytes(arrays=None) -> int:
    """Bytes of this process's buffers that `arrays` hold (every live array by default)."""
    return held_bytes(jax.live_arrays() if arrays is None else arrays)


def as_hosts_get_it_for(model: str, strategy: str, *extra: str):
    """The config with the layout rules the driver settles, as the hosts get it, and the mesh."""
    cfg, mesh = config(model, strategy, *extra)
    return as_hosts_get_it(cfg, mesh), mesh


def built_counting(cfg, mesh) -> tuple:
    """The model built and its optimizer state created, and the most this process held of
    its arrays meanwhile above what it held before: Keras makes a variable below its
    sharded-initialisation threshold whole, then places its shards (`distribute_tensor`,
    where both are alive)."""
    from keras.src.backend.jax import distribution_lib

    distribute, peaks, before = distribution_lib.distribute_tensor, [0], live_bytes()

    def distribute_and_count(value, layout):
        placed = distribute(value, layout)
        peaks.append(live_bytes() - before)
        return placed

    distribution_lib.distribute_tensor = distribute_and_count
    try:
        model, dataset = build_on_grid(cfg, device_grid(jax.devices(), mesh))
        model.optimizer.build(model.trainable_variables)
    finally:
        distribution_lib.distribute_tensor = distribute
    return model, max(peaks)


def build_and_restore_figures() -> None:
    import tempfile

    from training.host.checkpoints import HostCheckpoints

    with tempfile.TemporaryDirectory() as directory:
        cfg, mesh = as_hosts_get_it_for("wide_mlp", "fsdp", f"checkpoint.dir={directory}")
        model, building = built_counting(cfg, mesh)
        variables = [*model.variables, *model.optimizer.variables]
        share = live_bytes([v.value for v in variables])
        largest = max(v.value.nbytes for v in variables)
        checkpoints = HostCheckpoints(cfg, model)
        checkpoints.save(1)
        checkpoints.close()
        del model, variables, checkpoints
        keras.distribution.set_distribution(None)
        before = live_bytes()
        model, _ = built_counting(cfg, mesh)
        checkpoints = HostCheckpoints(cfg, model)
        read, held = checkpoints.manager.restore, [0]

        def restore_and_count(*args, **kwargs):
            restored = read(*args, **kwargs)
            held.append(live_bytes() - before)
            return restored

        checkpoints.manager.restore = restore_and_count
        checkpoints.restore_newest()
        checkpoints.close()
        keras.distribution.set_distribution(None)
    bound = share + largest
    print(
        f"  wide_mlp fsdp 8×1: share of the state {readable_bytes(share)}, largest variable "
        f"{readable_bytes(largest)}; held at most {readable_bytes(building)} building "
        f"({building / bound:.2f} of share + largest), {readable_bytes(max(held))} restoring "
        f"({max(held) / bound:.2f})"
    )


def preset_load_figures() -> None:
    """A keras-hub Llama preset (21 MB of weights, written here) loaded under fsdp: what this
    process held of its arrays while the weights were created and read (and the optimizer's
    slots built), against its share of both plus its largest weight (Keras places each weight
    read from the preset as it is assigned: whole on one device, then its shards)."""
    import tempfile

    import keras_hub

    with tempfile.TemporaryDirectory() as directory:
        keras.utils.set_random_seed(7)
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=256,
            num_layers=2,
            num_query_heads=8,
            num_key_value_heads=8,
            hidden_dim=512,
            intermediate_dim=1024,
        )
        keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None).save_to_preset(
            directory
        )
        del backbone
        cfg, mesh = as_hosts_get_it_for("llama", "fsdp", f"model.preset={directory}")
        model, loading = built_counting(cfg, mesh)
        weights = [v.value for v in model.variables]
        share, largest = live_bytes(weights), max(w.nbytes for w in weights)
        slots = live_bytes([v.value for v in model.optimizer.variables])
        del model, weights
        keras.distribution.set_distribution(None)
    bound = share + slots + largest
    print(
        f"  llama preset fsdp 8×1: share of the weights {readable_bytes(share)} and optimizer "
        f"state {readable_bytes(slots)}, largest weight {readable_bytes(largest)}; held at "
        f"most {readable_bytes(loading)} building and loading ({loading / bound:.2f} of "
        "share + largest)"
    )


def plan_against_accelerator(workloads: list[str]) -> None:
    """6: the plan's peak against the hosts' compiled step on one accelerator device."""
    import tempfile
    from pathlib import Path

    from bench_accelerator import VOCABULARY, overrides, write_tokens

    from training.events import OutOfDeviceMemory
    from training.host.loop import CompiledStep, batch_shardings, place
    from training.host.memory import memory_limit, out_of_memory_explained

    limit = memory_limit()
    print(f"  device {jax.devices()[0].device_kind}, {readable_bytes(limit or 0)} per device")
    print(
        f"  {'model':18} {'remat':5} {'plan':>9} {'compiled':>9} {'ratio':>6}  fits: plan, compiler"
    )
    with tempfile.TemporaryDirectory() as scratch:
        for workload in workloads:
            tokens = write_tokens(Path(scratch), VOCABULARY.get(workload, 256))
            for remat in REMATS:
                cfg = compose_run_config(
                    [*overrides(workload, tokens, 2), f"trainer.remat={remat}"]
                )
                spec = build_dataset(cfg.data).spec
                batch = cfg.trainer.micro_batch
                planned = memory_cost(
                    cfg, abstract_model(cfg, spec), "data_parallel", MeshShape(1, 1), batch
                ).total_bytes
                keras.backend.clear_session()
                model, dataset = built_as_hosts_build(cfg, MeshShape(1, 1))
                x = dataset.batch("train", 0, batch, slice(0, batch))
                runner = CompiledStep(model, cfg.trainer.accumulate, 0)
                try:
                    with out_of_memory_explained("by the compiler"):
                        runner.compile(place(x, batch_shardings(x)))
                    needed = runner.memory.needed
                except OutOfDeviceMemory as refused:
                    needed = refused.needed
                del model, runner
                ratio = f"{planned / needed:6.2f}" if needed else "     -"
                fits = [
                    "yes" if limit is None or planned <= limit else "no",
                    "yes" if needed and (limit is None or needed <= limit) else "no",
                ]
                print(
                    f"  {workload:18} {remat:5} {readable_bytes(planned):>9} "
                    f"{readable_bytes(needed or 0):>9} {ratio}  {', '.join(fits)}",
                    flush=True,
                )


def main(argv: list[str]) -> None:
    if ON_ACCELERATOR:
        print("6. plan ÷ compiled on this machine's accelerator, one device")
        chosen = [a.split("=", 1)[1] for a in argv if a.startswith("--workloads=")]
        plan_against_accelerator((chosen or ["transformer-86M,llama-lora"])[0].split(","))
        return
    print("1. fsdp: state per device and bytes sent")
    for model in ("wide_mlp", "transformer"):
        fsdp_figures(model, "fsdp")
    fsdp_figures("wide_mlp", "hybrid+fsdp")
    print("2. rematerialisation")
    remat_figures()
    if "--quick" not in argv:
        print("3. plan ÷ compiled, per device (state: weights + optimizer; peak: + temporaries)")
        plan_against_compiled()
    print("4. a model over the budget")
    budget_figures()
    print("5. building, restoring and loading a preset")
    build_and_restore_figures()
    preset_load_figures()


if __name__ == "__main__":
    main(sys.argv[1:])
