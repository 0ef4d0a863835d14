"""`traceml run` argument handling: torchrun's options pass through, TraceML's are split off."""
import signal

import pytest

from traceml.launcher import run
from traceml.launcher import run_dir as rd


def test_torchrun_options_and_script_args_pass_through_unchanged():
    args, options = run.parse(["--nproc-per-node", "2", "--max-restarts", "1", "--live",
                               "--run-id", "r1", "train.py", "--lr", "0.1", "--live"])
    assert args.nproc_per_node == "2"
    assert args.max_restarts == 1
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--lr", "0.1", "--live"]  # the script's own --live
    assert options.live is True and options.run_id == "r1"
    assert not hasattr(args, "live")


def test_torchrun_environment_form_is_honoured(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    args, _ = run.parse(["train.py"])
    assert args.nproc_per_node == "3"


def test_script_is_wrapped_by_the_bootstrap_module():
    args, _ = run.parse(["train.py", "--x", "1"])
    assert run.wrap_with_bootstrap(args)
    assert args.module is True
    assert args.training_script == run.BOOTSTRAP_MODULE
    assert args.training_script_args == ["train.py", "--x", "1"]


def test_module_entry_point_is_wrapped_with_dash_m():
    args, _ = run.parse(["-m", "pkg.train", "--x", "1"])
    assert run.wrap_with_bootstrap(args)
    assert args.training_script_args == ["-m", "pkg.train", "--x", "1"]


def test_no_python_entry_point_is_left_alone():
    args, _ = run.parse(["--no-python", "./train.sh"])
    assert not run.wrap_with_bootstrap(args)
    assert args.training_script == "./train.sh"


def test_bad_refresh_is_a_usage_error():
    with pytest.raises(SystemExit):
        run.parse(["--live", "--refresh", "0", "train.py"])


@pytest.mark.parametrize("explicit, rdzv, environ, expected, source", [
    ("cli", "rdzv", {"TRACEML_RUN_ID": "env", "SLURM_JOB_ID": "9"}, "cli", "argument"),
    (None, "rdzv", {"TRACEML_RUN_ID": "env", "SLURM_JOB_ID": "9"}, "env", "TRACEML_RUN_ID"),
    (None, "rdzv", {"SLURM_JOB_ID": "9"}, "rdzv", "TORCHELASTIC_RUN_ID"),  # --rdzv-id: the ranks' variable
    (None, "none", {"SLURM_JOB_ID": "9"}, "9", "SLURM_JOB_ID"),
    (None, None, {"TRACEML_RUN_ID": "  "}, None, "generated"),
])
def test_run_id_precedence(explicit, rdzv, environ, expected, source):
    resolved = rd.resolve_run_id(explicit, rdzv, environ)
    assert resolved.source == source
    if expected is not None:
        assert resolved.run_id == expected


def test_generated_run_ids_differ_between_launches():
    assert rd.resolve_run_id(None, None, {}).run_id != rd.resolve_run_id(None, None, {}).run_id


@pytest.mark.parametrize("run_id", ["20260101-abc", "../../etc/passwd", "a/b c", ".."])
def test_run_folders_stay_directly_under_the_runs_dir(tmp_path, run_id):
    folder = rd.run_directory(tmp_path, run_id)
    assert folder.parent == tmp_path.resolve()
    assert folder.name not in ("", ".", "..")


def test_exit_codes_are_forwarded_like_a_shell_would():
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failed = ChildFailedError("train", {1: ProcessFailure(1, 123, 3, "<N/A>")})
    assert run.exit_code_of(failed) == 3
    killed = ChildFailedError("train", {0: ProcessFailure(0, 124, -int(signal.SIGKILL), "<N/A>")})
    assert run.exit_code_of(killed) == 128 + int(signal.SIGKILL)
    assert run.exit_code_of(SignalException("term", signal.SIGTERM)) == 128 + int(signal.SIGTERM)
    assert run.exit_code_of(KeyboardInterrupt()) == 130


_NO_TORCH_CLI = """
import sys
for name in ("torch", "transformers", "lightning", "pytorch_lightning"):
    sys.modules[name] = None
from traceml.launcher.cli import main
assert main(["--help"]) == 0
assert main(["compare", "missing_a.json", "missing_b.json"]) == 2
assert main(["summary", "missing_dir"]) == 2
print("ok")
"""


@pytest.mark.slow
def test_help_compare_and_summary_work_without_torch():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_TORCH_CLI], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
