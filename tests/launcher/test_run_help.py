"""`traceml run --help` answers without importing torch (issue 31 item 5: it took ~4 s for the help).

The TraceML options come from the same `add_traceml_options` the real parser uses; a `--help`
after a value or the script still goes to torch's parser (it may be the script's own flag). A run
where torch is not installed says so in one line (status 2), not with an ImportError traceback.
"""
from __future__ import annotations

from harness.child_python import python_output
from traceml.launcher import run

_NO_TORCH_HELP = """
import contextlib, io, sys
for name in ("torch", "transformers", "lightning", "pytorch_lightning"):
    sys.modules[name] = None  # any import of these now raises ImportError
from traceml.launcher.cli import main
text = io.StringIO()
with contextlib.redirect_stdout(text):
    code = main(["run", "--help"])
loaded = [n for n, m in sys.modules.items() if m is not None and n.split(".")[0] == "torch"]
print(code, loaded, "--endpoint URL" in text.getvalue(), "--processor-token-file" in text.getvalue(),
      "torchrun --help" in text.getvalue())
errors = io.StringIO()
with contextlib.redirect_stderr(errors):
    launched = main(["run", "--nproc-per-node", "2", "train.py"])
print(launched, "PyTorch (torch) is not installed" in errors.getvalue())
"""


def test_run_help_answers_without_torch_and_a_run_without_torch_says_so():
    assert python_output(_NO_TORCH_HELP).splitlines() == ["0 [] True True True", "2 True"]  # a run: one line


def test_only_a_leading_help_is_ours():
    assert run.asks_for_help_only(["--help"]) and run.asks_for_help_only(["--live", "-h"])
    assert not run.asks_for_help_only(["--nproc-per-node", "2", "--help"])  # torch's parser decides
    assert not run.asks_for_help_only(["train.py", "--help"])  # the script's own flag
    assert not run.asks_for_help_only(["--", "--help"]) and not run.asks_for_help_only([])
