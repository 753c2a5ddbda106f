"""The trained model out in Keras' own format: `model.keras` (architecture, every variable
including non-trainable state such as BatchNormalization's moving statistics, the optimizer's
state), which `keras.saving.load_model` opens in a plain one-device process.

Every host calls `export_model` at the same point. Keras' saving reads each variable as one
numpy array; a variable split over several hosts' devices is gathered for it there, one at a
time (a collective every host joins, in the same order, since every host saves the same
model), so a host holds at most its own shards plus one whole variable. Host 0 writes the
file under a temporary name in the target directory and renames it into place: a crash
mid-write leaves no half file. The other hosts' copies go to a temporary directory. A bucket
URL (gs://, s3://): Keras writes to files, so host 0 writes to a local temporary directory
and uploads that through fsspec (gcsfs, s3fs), each file one object.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

from training import keras_compat
from training.config import url_scheme
from training.data.storage import bucket_filesystem


def gathered(array):
    """A value split over several hosts' devices, gathered whole (a collective every host
    joins); None for any other, which Keras reads itself (it reads only what this process
    holds whole)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return None
    if array.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def writes_preset(model) -> bool:
    """A keras-hub model (training/models/hub.py) is exported as a keras-hub preset."""
    return callable(getattr(model, "save_to_preset", None))


def export_model(
    model, path: str, max_shard_gb: float | None = None, lora_only: bool = False
) -> str:
    """Write `model` to `path` from host 0; every host must call it. `path` is a `.keras`
    file, or with `max_shard_gb` a directory of the model's architecture (`model.json`,
    for `keras.models.model_from_json`) and its weights in shards of at most that size
    (`model.weights.json`, for `model.load_weights`). A keras-hub model: a preset directory
    (LoRA merged into the kernels; weights sharded above `max_shard_gb`, keras-hub's 10 GB
    by default), or with `lora_only` its LoRA weights alone (a `.lora.h5` file)."""
    with written_from_host_0(path) as staged, keras_compat.saving_reads_with(gathered):
        if writes_preset(model) and lora_only:
            model.save_lora_weights(staged)
        elif writes_preset(model):
            model.save_to_preset(staged, max_shard_size=max_shard_gb or 10)
        elif max_shard_gb:
            os.makedirs(staged)
            model.save_weights(os.path.join(staged, SHARDED_WEIGHTS), max_shard_size=max_shard_gb)
            with open(os.path.join(staged, SHARDED_ARCHITECTURE), "w") as file:
                file.write(model.to_json())
        else:
            model.save(staged)
    return path


@contextmanager
def written_from_host_0(path: str):
    """A staging path to write `path` at (every host writes; host 0's copy is moved into
    place, the others' are dropped), in a temporary directory beside `path` on host 0."""
    import jax

    writer = jax.process_index() == 0
    bucket = url_scheme(path) is not None
    directory = os.path.dirname(path if bucket else os.path.abspath(path))
    if writer and not bucket:
        os.makedirs(directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=directory if writer and not bucket else None)
    try:
        staged = os.path.join(staging, os.path.basename(path))
        yield staged
        if writer:
            (_upload if bucket else _replace)(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


SHARDED_WEIGHTS, SHARDED_ARCHITECTURE = "model.weights.json", "model.json"


def _replace(staged: str, path: str) -> None:
    """Move `staged` (a file or a directory) to `path`, in place of what is there."""
    if not os.path.isdir(path):
        os.replace(staged, path)
        return
    old = tempfile.mkdtemp(prefix=".replaced-", dir=os.path.dirname(path))
    os.replace(path, os.path.join(old, "old"))
    os.replace(staged, path)
    shutil.rmtree(old, ignore_errors=True)


def _upload(staged: str, url: str) -> None:
    """Upload `staged` (a file or a directory) to the bucket URL `url`, in place of what is
    there."""
    fs = bucket_filesystem(url_scheme(url))
    if fs.exists(url):
        fs.rm(url, recursive=True)
    fs.put(staged, url, recursive=os.path.isdir(staged))
