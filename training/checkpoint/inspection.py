"""The driver's look at checkpoint.dir before any host trains (while the hosts' actors start).

The driver reads only the JSON record and the array metadata, so a checkpoint of another
run, a corrupt one or an unwritable directory is an error before any host trains where
the driver sees the directory.
"""

from __future__ import annotations

from training.checkpoint.record import check_format, record_differences, refusal, resume_record
from training.checkpoint.storage import (
    RECORD,
    STATE,
    CheckpointError,
    check_writable,
    checkpoint_path,
    open_manager,
    unreadable,
)
from training.config import CheckpointConfig, ConfigError, RunConfig, url_scheme
from training.contracts import VariableInfo


def inspect_checkpoints(
    cfg: RunConfig, variables: list[VariableInfo], data_fingerprint: str
) -> int | None:
    """The step of the newest checkpoint in checkpoint.dir as the driver sees it (None: a
    fresh start), after checking that the directory is writable, the checkpoint readable
    and of this run.

    The driver is not a host: on a Ray cluster a filesystem path it does not have is left
    to the hosts to check (`training.host.checkpoints.agree_on_directory`), and nothing is
    created on the driver."""
    directory = checkpoint_path(cfg.checkpoint.dir)
    if _left_to_the_hosts(cfg):
        return None
    check_writable(directory)
    if not directory.exists():
        return None
    try:
        manager = open_manager(cfg.checkpoint, read_only=True)
        step = manager.latest_step()
    except Exception as error:
        raise ConfigError(unreadable(directory, None, error)) from None
    if step is None:
        return None
    record = read_record(manager, directory, step)
    try:
        check_format(record, str(directory), step)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    found = record_differences(
        record,
        resume_record(cfg, data_fingerprint),
        {v.path: list(v.shape) for v in variables},
        cfg.checkpoint.allow_changes,
    )
    if found.stop:
        raise ConfigError(refusal(str(directory), step, found))
    return step


def newest_figures(cfg: CheckpointConfig) -> dict:
    """The figures logged at the newest checkpoint's step (`final_loss`, `final_<metric>`,
    `eval_*`), as its record keeps them; {} where it kept none."""
    return newest_record(cfg).get("figures", {})


def newest_run_config(cfg: CheckpointConfig) -> dict:
    """The config values (by group) the newest checkpoint's record keeps; {} where there is
    no checkpoint."""
    return newest_record(cfg).get("run_config", {}).get("values", {})


def newest_record(cfg: CheckpointConfig) -> dict:
    """The newest checkpoint's record; {} where there is none."""
    step = newest_step(cfg)
    if step is None:
        return {}
    return read_record(open_manager(cfg, read_only=True), checkpoint_path(cfg.dir), step)


def restart_step(cfg: RunConfig, saved: int) -> int:
    """The step a fresh host group resumes from: the newest checkpoint's (0 without
    checkpoints). `saved`: the newest step a checkpoint of this run is known to have reached
    (0: none), the one resumed from or one the hosts trained past (`saved_before`). A
    directory that no longer holds it (deleted, emptied, unreadable), or whose newest
    checkpoint cannot be read, is a ConfigError: a restart never trains again from an older
    step, or from 0, without a word. Where the driver does not see the directory (a path on a
    cluster's hosts), the hosts find the step; `saved` is what the driver knows."""
    if not cfg.checkpoint.enabled:
        return 0
    if _left_to_the_hosts(cfg):
        return saved
    directory = checkpoint_path(cfg.checkpoint.dir)
    step = newest_step(cfg.checkpoint)
    if step is None or step < saved:
        raise ConfigError(
            f"checkpoint.dir={directory} held a checkpoint at step {saved}, but "
            + ("holds none now" if step is None else f"its newest is now step {step}")
            + f": a restart would train again from step {step or 0}. Restore the directory "
            "and run the same command to resume"
        )
    if step:
        read_record(open_manager(cfg.checkpoint, read_only=True), directory, step)
    return step or 0


def saved_before(step: int, cfg: CheckpointConfig) -> int:
    """The newest checkpoint a run whose every host finished `step` steps has saved (0:
    none): the last multiple of checkpoint.interval before it, since hosts save at such a
    step, and synchronously, before they go on to the next."""
    if not cfg.enabled or step <= 0:
        return 0
    return (step - 1) // cfg.interval * cfg.interval


def _left_to_the_hosts(cfg: RunConfig) -> bool:
    """On a Ray cluster the driver is not a host: a filesystem path it does not have is
    checked by the hosts (`training.host.checkpoints.agree_on_directory`)."""
    remote_hosts = cfg.cluster.name != "local" and not url_scheme(cfg.checkpoint.dir)
    return remote_hosts and not checkpoint_path(cfg.checkpoint.dir).exists()


def newest_step(cfg: CheckpointConfig) -> int | None:
    """The newest step in checkpoint.dir as this process sees it; None where the directory
    does not exist or holds none. A directory that cannot be listed, or a path that is not a
    directory, is a ConfigError naming it and why."""
    directory = checkpoint_path(cfg.dir)
    try:
        if not directory.exists():
            return None
        if not directory.is_dir():
            raise NotADirectoryError(f"{directory} is not a directory")
        return open_manager(cfg, read_only=True).latest_step()
    except Exception as error:
        raise ConfigError(unreadable(directory, None, error)) from None


def read_record(manager, directory, step: int) -> dict:
    """The JSON record of a step, after checking its arrays' metadata is readable too."""
    import orbax.checkpoint as ocp

    try:
        record = manager.restore(step, args=ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()}))
        arrays = manager.item_metadata(step)[STATE]
        if arrays is None:
            raise CheckpointError(f"no array metadata under {STATE}/")
    except Exception as error:
        raise ConfigError(unreadable(directory, step, error)) from None
    return record[RECORD]
