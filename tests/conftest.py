"""Fixtures shared by the tests under tests/; the repository's modules are imported from its
root."""

import json
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from helpers import qa_rows, trained_model, write  # noqa: E402  (needs the path above)
from support import corpora  # noqa: E402


@pytest.fixture
def qa_file(tmp_path):
    """(path, rows) of a .json file of qa_rows()."""
    rows = qa_rows()
    return write(tmp_path, "sums.json", json.dumps(rows)), rows


@pytest.fixture(scope="session")
def stdlib():
    """The records of the built-in stdlib corpus (built once per test session)."""
    return corpora.stdlib_records()


@pytest.fixture(scope="session")
def arith():
    """What prepare() builds for --dataset=arith (built once per test session)."""
    return corpora.DATASETS["arith"]()


@pytest.fixture(scope="session")
def refusion_model(tmp_path_factory):
    """(model, ids) of a small ReFusion model trained for the tests (helpers.trained_model)."""
    return trained_model(tmp_path_factory, "refusion")


@pytest.fixture(scope="session")
def mdm_model(tmp_path_factory):
    """(model, ids) of a small MDM trained for the tests (helpers.trained_model)."""
    return trained_model(tmp_path_factory, "mdm")
