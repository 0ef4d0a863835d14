"""Fixtures of the launcher tests (helpers live in launcher_helpers.py)."""
from pathlib import Path

import pytest

from tests.launcher.launcher_helpers import PLAIN_DDP_STEPS, SCRIPTS, TracemlRun, traceml


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def plain_ddp_run(tmp_path_factory) -> TracemlRun:
    """One `traceml run` of the marked plain DDP script (2 gloo ranks, PLAIN_DDP_STEPS steps, the
    embedded processor), read by every test that checks what such a run leaves: a launcher run
    costs more than all their assertions together. Tests must not write into its folder."""
    workdir = tmp_path_factory.mktemp("plain_ddp")
    return traceml(["run", "--nproc-per-node", "2", str(SCRIPTS / "plain_ddp.py"),
                    "--steps", str(PLAIN_DDP_STEPS)], workdir)
