"""`python -m training.export CHECKPOINT_DIR [OUT]`: a saved checkpoint as `model.keras`, the
same file a run exports at its end (`training.checkpoint.export`), in one process on one
device, with no cluster: a checkpoint written under another mesh, or a sweep's best trial.

The checkpoint's record holds the run's config and its data's spec, so the model is built
again without the data; a model from your own file needs that file importable, as in the
run (run this from the directory the run was started in). OUT defaults to
CHECKPOINT_DIR/model.keras; for a keras-hub model (`model=hub`), to the preset directory
CHECKPOINT_DIR/preset (or CHECKPOINT_DIR/model.lora.h5 with `export.lora_only`), and beside
it, as a run writes them, `hf/` (the transformers format) and with LoRA `hf-adapter/` (a PEFT
adapter) where transformers computes the model (`training.checkpoint.hf_export`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from rich.console import Console  # noqa: E402

from training.build import build_compiled  # noqa: E402
from training.checkpoint.export import export_model, writes_preset  # noqa: E402
from training.checkpoint.hf_export import export_for_transformers, hf_export_lines  # noqa: E402
from training.checkpoint.inspection import newest_step, read_record  # noqa: E402
from training.checkpoint.storage import CheckpointError, open_manager  # noqa: E402
from training.config import (  # noqa: E402
    EXPORT_FILE,
    PRESET_EXPORT,
    CheckpointConfig,
    ConfigError,
    run_config_from_record,
    url_scheme,
)
from training.contracts import data_spec_from_dict  # noqa: E402
from training.host.checkpoints import HostCheckpoints  # noqa: E402


def export_checkpoint(
    directory: str, out: str | None = None, step: int | None = None
) -> tuple[str, dict | None]:
    """Export checkpoint `step` (default: the newest) of `directory` to `out`: its path, and
    for a keras-hub model what `export_for_transformers` wrote beside it (None for another)."""
    if not out and url_scheme(directory):
        raise CheckpointError(
            f"{directory} is a bucket URL, and Keras writes to files: give OUT, a local path"
        )
    cfg, model = restored_model(directory, step)
    if not out:
        export = replace(cfg.export, enabled=True, dir=cfg.checkpoint.dir)
        out = export.path(keras_hub=writes_preset(model))
    path = export_model(model, out, cfg.export.max_shard_gb, cfg.export.lora_only)
    if not writes_preset(model):
        return path, None
    beside = os.path.dirname(os.path.abspath(path))
    hf_export = export_for_transformers(
        model, beside, base=getattr(cfg.model, "preset", ""), merged=not cfg.export.lora_only
    )
    return path, hf_export


def restored_model(directory: str, step: int | None = None):
    """(the run's config, its model compiled on one device with checkpoint `step` of
    `directory` restored into it; default: the newest)."""
    checkpoint = CheckpointConfig(dir=directory)
    directory = checkpoint.dir  # absolute, or a bucket URL
    step = step if step is not None else newest_step(checkpoint)
    if step is None:
        raise CheckpointError(f"{directory} holds no checkpoint")
    record = read_record(open_manager(checkpoint, read_only=True), directory, step)
    if "run_config" not in record:
        raise CheckpointError(
            f"the checkpoint at step {step} in {directory} was written before checkpoints "
            "recorded their run's config; export it by resuming the run (training.run with "
            "its checkpoint.dir), which writes model.keras at its end"
        )
    cfg = replace(run_config_from_record(record["run_config"]), checkpoint=checkpoint)
    data_spec = data_spec_from_dict(record["data_spec"])
    model = build_compiled(cfg, data_spec)
    checkpoints = HostCheckpoints(cfg, model, data_spec)
    checkpoints.restore(step)
    checkpoints.close()
    return cfg, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.export",
        description="Write a saved checkpoint as a run exports at its end: model.keras, or a "
        "keras-hub model's preset directory with hf/ (and hf-adapter/) beside it.",
    )
    parser.add_argument("checkpoint_dir", help="a run's checkpoint.dir (a path or a bucket URL)")
    parser.add_argument(
        "out",
        nargs="?",
        help=f"where (default: CHECKPOINT_DIR/{EXPORT_FILE}, CHECKPOINT_DIR/{PRESET_EXPORT} for "
        "a keras-hub model, CHECKPOINT_DIR/model with export.max_shard_gb)",
    )
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    args = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    try:
        path, hf_export = export_checkpoint(args.checkpoint_dir, args.out, args.step)
    except (CheckpointError, ConfigError) as error:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {error}")
        return 2
    console.print(f"model: {path}")
    for line in hf_export_lines(hf_export):
        console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
