"""`export`: the trained model written out in Keras' own format at the end of a run
(`training.checkpoint.export`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from training.config.checkpoint import url_scheme
from training.config.common import require

# Bucket URLs an export is uploaded to (training.checkpoint.export).
EXPORT_URL_SCHEMES = ("gs", "s3")

EXPORT_FILE = "model.keras"
SHARDED_EXPORT = "model"  # a directory: model.json, model.weights.json and its shards
PRESET_EXPORT = "preset"  # a keras-hub model's: a preset directory
LORA_EXPORT = "model.lora.h5"  # its LoRA weights alone (keras-hub's save_lora_weights)
# Beside a keras-hub model's export: the transformers format, and its LoRA as a PEFT adapter
HF_EXPORT, HF_ADAPTER_EXPORT = "hf", "hf-adapter"


@dataclass
class ExportConfig:
    """`model.keras` (architecture, weights, optimizer state), or its sharded form, written
    by host 0 when the run ends, completed or preempted; a keras-hub model (`model=hub`) as
    a keras-hub preset directory `preset/` (or its LoRA weights alone)."""

    enabled: bool = True
    # A directory host 0 writes and the driver's user reads, or a gs:// or s3:// bucket URL
    # (written on host 0's disk, then uploaded). Empty: the run's own directory on a local
    # cluster; on a Ray cluster, checkpoint.dir where it is a path (hosts' nodes and the
    # driver's machine share it), else nothing is exported.
    dir: str = ""
    # A model too large to hold whole in one host's memory: its weights written as shards
    # of at most this many GB (Keras' `save_weights(max_shard_size=...)`) with its
    # architecture as JSON, in a directory `model/`. None: one model.keras file.
    max_shard_gb: Optional[float] = None
    # A keras-hub model with LoRA: write only the LoRA weights (model.lora.h5, for keras-hub's
    # `backbone.load_lora_weights`) instead of the preset with LoRA merged into its kernels.
    lora_only: bool = False

    def __post_init__(self) -> None:
        require(
            self.max_shard_gb is None or self.max_shard_gb > 0,
            "export.max_shard_gb must be > 0 (or null for one model.keras)",
        )
        scheme = url_scheme(self.dir)
        require(
            scheme in (None, *EXPORT_URL_SCHEMES),
            f"export.dir={self.dir!r}: {scheme}:// is not a storage this writes to; give a "
            "filesystem path (a shared one on a cluster) or a gs:// or s3:// URL",
        )
        if self.dir and scheme is None:
            self.dir = os.path.abspath(os.path.expanduser(self.dir))

    def path(self, keras_hub: bool = False) -> str | None:
        """Where the model goes (`keras_hub`: a keras-hub model's); None where there is no
        directory for it."""
        if not (self.enabled and self.dir):
            return None
        if keras_hub:
            return os.path.join(self.dir, LORA_EXPORT if self.lora_only else PRESET_EXPORT)
        return os.path.join(self.dir, SHARDED_EXPORT if self.max_shard_gb else EXPORT_FILE)
