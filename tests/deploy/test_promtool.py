"""`promtool check config`, `check rules` and `test rules` on the committed Prometheus files."""
from __future__ import annotations

import shutil
import subprocess

import pytest
from tests.deploy.deploy_files import PROMETHEUS_DIR

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (apt-get install prometheus)")
RULES = PROMETHEUS_DIR / "rules"


def promtool(*args: str, cwd=PROMETHEUS_DIR) -> str:
    result = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_check_config_loads_the_rule_files():
    out = promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in out and "11 rules found" in out


def test_check_rules():
    files = sorted(p.name for p in RULES.glob("*.rules.yml"))
    assert files
    assert "SUCCESS" in promtool("check", "rules", *files, cwd=RULES)


@pytest.mark.slow
def test_rule_unit_tests_pass():
    tests = sorted(p.name for p in RULES.glob("*_test.yml"))
    assert tests
    assert "SUCCESS" in promtool("test", "rules", *tests, cwd=RULES)


@pytest.mark.slow
def test_a_broken_expectation_fails(tmp_path):
    """The unit tests can fail: flip one expected alert and promtool must refuse it."""
    text = (RULES / "traceml.rules_test.yml").read_text()
    broken = text.replace('"eval_time": "30s"', '"eval_time": "3m"', 1)
    assert broken != text
    (tmp_path / "traceml.rules.yml").write_text((RULES / "traceml.rules.yml").read_text())
    (tmp_path / "broken_test.yml").write_text(broken)
    result = subprocess.run(["promtool", "test", "rules", "broken_test.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
