"""The per-rank bootstrap runs the user's code exactly like `python script.py` / `python -m mod`."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.launcher.launcher_helpers import clean_env

PROBE = textwrap.dedent("""
    import sys, traceml
    print("name", __name__)
    print("argv", sys.argv)
    print("path0", sys.path[0])
    print("initialized", traceml.is_initialized())
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[-1]))
    if "--raise" in sys.argv:
        raise ValueError("boom from the script")
""")


def _bootstrap(args, cwd, **env):
    return subprocess.run([sys.executable, "-m", "traceml.launcher.bootstrap", *args], cwd=cwd,
                          env=clean_env(**env), capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_script_runs_as_main_with_its_argv_and_folder_and_traceml_initialised(tmp_path):
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "probe.py"
    script.write_text(PROBE)
    out = _bootstrap([str(script), "--a", "1"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name __main__" in out.stdout
    assert f"argv ['{script}', '--a', '1']" in out.stdout
    assert f"path0 {script.parent}" in out.stdout
    assert "initialized True" in out.stdout


@pytest.mark.slow
def test_exit_status_and_exceptions_propagate_unchanged(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    assert _bootstrap([str(script), "--exit", "5"], tmp_path).returncode == 5
    raised = _bootstrap([str(script), "--raise"], tmp_path)
    assert raised.returncode == 1
    assert "ValueError: boom from the script" in raised.stderr


@pytest.mark.slow
def test_module_entry_point(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(PROBE)
    out = _bootstrap(["-m", "pkg.train", "--x"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "name __main__" in out.stdout and "'--x'" in out.stdout


def test_kill_switch_leaves_the_script_running_without_traceml(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = _bootstrap([str(script)], tmp_path, TRACEML_DISABLE="1")
    assert out.returncode == 0, out.stderr
    assert "initialized False" in out.stdout


@pytest.mark.slow
def test_exit_after_flush_runs_atexit_handlers_and_keeps_failure_statuses(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE + textwrap.dedent("""
        import atexit
        atexit.register(lambda: print("atexit ran", flush=True))
        print("unflushed tail", end="")
    """))
    out = _bootstrap([str(script)], tmp_path, TRACEML_EXIT_AFTER_FLUSH="1")
    assert out.returncode == 0, out.stderr
    assert "unflushed tail" in out.stdout and "atexit ran" in out.stdout
    failed = _bootstrap([str(script), "--exit", "5"], tmp_path, TRACEML_EXIT_AFTER_FLUSH="1")
    assert failed.returncode == 5, failed.stderr
