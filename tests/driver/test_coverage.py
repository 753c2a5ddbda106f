"""The driver's check of what each host fed: the hosts' shares tile each batch, and each host
read exactly the examples of its share, in the data's own order."""

import numpy as np
import pytest

from tests.conftest import run_config
from training.data import build_dataset
from training.driver.coverage import RowCoverage, WrongRows

BATCH = ["trainer.global_batch=32"]


@pytest.fixture(autouse=True)
def numbered_rows(tmp_path, monkeypatch):
    """Data whose every example carries its row id in its features, so what a host feeds
    says which rows it read, independently of the order the check expects."""
    monkeypatch.chdir(tmp_path)
    ids = np.arange(300, dtype=np.float32)
    np.savez(tmp_path / "numbered.npz", x=np.stack([ids, -ids], axis=1), y=ids.astype(np.int32))


def coverage(*overrides: str) -> RowCoverage:
    data = ["data=arrays", "data.path=numbered.npz"]
    cfg = run_config([*BATCH, *data, *overrides])
    return RowCoverage(build_dataset(cfg.data), cfg.trainer)


def fed(check: RowCoverage, step: int, share: slice) -> list[int]:
    """What a correct host with `share` feeds at `step`: the ids in the batches it reads."""
    k, size = check.trainer.accumulate, check.trainer.micro_batch
    return [
        int(row_id)
        for m in range(k)
        for row_id in check.dataset.batch("train", (step - 1) * k + m, size, share)[0][:, 0]
    ]


def test_hosts_that_fed_their_rows_pass():
    check = coverage()
    check.add_host(0, (0, 16))
    check.add_host(1, (16, 32))
    for step in (1, 7):
        check.check(step, [fed(check, step, slice(0, 16)), fed(check, step, slice(16, 32))])
    assert check.checked_steps == 2


def test_a_host_that_fed_another_hosts_rows_is_caught():
    check = coverage()
    check.add_host(0, (0, 16))
    check.add_host(1, (16, 32))
    wrong = fed(check, 3, slice(0, 16))
    with pytest.raises(WrongRows, match="host 1 fed other examples than its rows 16:32 of global"):
        check.check(3, [fed(check, 3, slice(0, 16)), wrong])


def test_a_host_a_step_behind_is_caught():
    check = coverage()
    check.add_host(0, (0, 32))
    with pytest.raises(WrongRows, match="host 0 fed other examples"):
        check.check(5, [fed(check, 4, slice(0, 32))])


def test_shares_that_overlap_or_leave_a_gap_are_caught():
    check = coverage()
    check.add_host(0, (0, 16))
    check.add_host(1, (8, 24))
    with pytest.raises(WrongRows, match="rows 8:16 are fed twice"):
        check.check(1, [[], []])
    check.shares[1] = slice(20, 32)
    with pytest.raises(WrongRows, match="rows 16:20 are fed by no host"):
        check.check(1, [[], []])


def test_hosts_sharing_rows_and_micro_batches():
    check = coverage("trainer.accumulate=2")
    for host in (0, 1):  # model parallel: every host feeds the whole (micro-)batch
        check.add_host(host, (0, 16))
    rows = fed(check, 2, slice(0, 16))
    assert len(rows) == 32
    check.check(2, [rows, rows])
