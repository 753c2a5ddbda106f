"""Memory held while building, restoring and loading, under fsdp on 8 simulated CPU devices
(this process the one host): the most this process held of its arrays against its share of
the state plus its largest variable (target <= 1.00):

- wide_mlp while the model and its optimizer state were built, and while a checkpoint was
  restored;
- a keras-hub Llama preset (21 MB of weights, written here) while its weights were created
  and read and the optimizer's slots built.

    python -m scripts.bench.build_memory
"""

from __future__ import annotations

import tempfile

from scripts.bench.harness import memory_config, ratio, use_eight_cpu_devices, write_results


def live_bytes(arrays=None) -> int:
    """Bytes of this process's buffers that `arrays` hold (every live array by default)."""
    import jax

    from training.planning.compiled import held_bytes

    return held_bytes(jax.live_arrays() if arrays is None else arrays)


def as_hosts_get_it_for(model: str, strategy: str, *extra: str):
    """The config with the layout rules the driver settles, as the hosts get it, and the mesh."""
    from training.planning.compiled import as_hosts_get_it

    cfg, mesh = memory_config(model, strategy, *extra)
    return as_hosts_get_it(cfg, mesh), mesh


def built_counting(cfg, mesh) -> tuple:
    """The model built and its optimizer state created, and the most this process held of
    its arrays meanwhile above what it held before: Keras makes a variable below its
    sharded-initialisation threshold whole, then places its shards (`distribute_tensor`,
    where both are alive)."""
    import jax
    from keras.src.backend.jax import distribution_lib

    from training.build import build_on_grid
    from training.parallel.mesh import device_grid

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


def build_and_restore_figures() -> dict:
    import keras

    from training.host.checkpoints import HostCheckpoints
    from training.parallel.dtypes import readable_bytes

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
        f"{readable_bytes(largest)}; held at most {readable_bytes(building)} building, of "
        f"share + largest {ratio(building / bound, '<= 1.00')}; {readable_bytes(max(held))} "
        f"restoring, {ratio(max(held) / bound, '<= 1.00')}"
    )
    return {"bound": bound, "building": building, "restoring": max(held)}


def preset_load_figures() -> dict:
    """Keras places each weight read from the preset as it is assigned: whole on one device,
    then its shards."""
    import keras
    import keras_hub

    from training.parallel.dtypes import readable_bytes

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
        f"most {readable_bytes(loading)} building and loading, of share + largest "
        f"{ratio(loading / bound, '<= 1.00')}"
    )
    return {"bound": bound, "loading": loading}


def main() -> None:
    use_eight_cpu_devices()
    print("building, restoring and loading a preset")
    found = {"wide_mlp": build_and_restore_figures(), "llama_preset": preset_load_figures()}
    write_results("build_memory", found)


if __name__ == "__main__":
    main()
