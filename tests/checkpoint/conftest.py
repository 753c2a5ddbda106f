"""One checkpoint trained for every test that only reads it or breaks a copy of it (each
`trained_checkpoint` trains and saves a model): `saved_checkpoint(directory)` copies it there
and returns what it holds."""

import shutil

import pytest

from tests.checkpoint.test_checkpoint import trained_checkpoint


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory):
    directory = tmp_path_factory.mktemp("trained_once")
    return directory, trained_checkpoint(directory)


@pytest.fixture
def saved_checkpoint(trained_once):
    original, saved = trained_once

    def copy_to(directory):
        shutil.copytree(original, directory, dirs_exist_ok=True)
        return saved

    return copy_to
