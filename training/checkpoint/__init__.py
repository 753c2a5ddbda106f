"""Sharded checkpoints of the whole training state, written and read with orbax.

A checkpoint holds every model variable (weights and the layers' seed-generator state),
every optimizer variable (moments, iteration count) and a JSON record of the step and of
what a resume must match. The data position is the step itself: step s reads global batch
s. Each host writes the shards it holds; orbax writes a step into a temporary directory and
renames it when every host has finished, so a crash mid-save leaves the previous checkpoint
as it was. Nothing ever deletes a checkpoint except orbax's `max_to_keep`.

Both sides use this package: the driver reads only a checkpoint's record and array metadata
(`inspection`), each host saves and restores its shards (`training.host.checkpoints`).
- `storage`: where checkpoints live (a path or a bucket URL), the orbax manager, whether a
  process can write there, and how many bytes a step takes;
- `record`: what a resume must match, how a checkpoint's record differs, and the refusal;
- `views`: each host's view of the directory, and the check that all hosts see the same one;
- `inspection`: the driver's check of the directory before any host trains.
"""
