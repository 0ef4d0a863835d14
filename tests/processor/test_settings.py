"""`traceml.processor.settings`: each processor setting declared once, checked strictly, documented truly."""
from __future__ import annotations

import ast
import logging
import pathlib
import re
import subprocess
import sys
import time

import pytest

from traceml.processor import settings as s
from traceml.processor.cli import build_parser, config_from_args
from traceml.processor.service import ProcessorConfig
from traceml.schema import env_values

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUMBERS = [x for x in s.SETTINGS if isinstance(x.kind, s.Number)]
ADDRESSES = [x for x in s.SETTINGS if isinstance(x.kind, s.Address)]


def _bad_values(setting: s.Setting) -> list[str]:
    kind = setting.kind
    below = str(int(kind.minimum) - 1) if kind.kind is int else str(kind.minimum)  # the bound itself is out
    bad = [below, "abc", "-1"]
    bad += ["1.5"] if kind.kind is int else ["nan", "inf"]
    return bad


def _good_values(setting: s.Setting) -> tuple[str, str]:
    """Two valid values, both different from the default."""
    if setting.kind.kind is int:
        return str(setting.default + 3), str(setting.default + 5)
    return "7.25", "9.5"


# --- strict: a value outside its range names the flag or variable, the value and the range ----


@pytest.mark.parametrize("setting", NUMBERS + ADDRESSES, ids=lambda x: x.name)
def test_a_bad_flag_is_refused_naming_the_flag_the_value_and_the_range(setting):
    for bad in (_bad_values(setting) if setting in NUMBERS else ["nonsense", "host:99999", "host:port"]):
        with pytest.raises(s.SettingError) as caught:
            config_from_args([setting.flag, bad], environ={})
        message = str(caught.value)
        assert setting.flag in message and repr(bad) in message and setting.kind.expected in message, message


@pytest.mark.parametrize("setting", NUMBERS + ADDRESSES, ids=lambda x: x.name)
def test_a_bad_variable_is_refused_naming_the_variable_the_value_and_the_range(setting):
    for bad in (_bad_values(setting) if setting in NUMBERS else ["nonsense", "host:99999"]):
        with pytest.raises(s.SettingError) as caught:
            config_from_args([], environ={setting.variable: bad})
        message = str(caught.value)
        assert f"{setting.variable}={bad!r}" in message and setting.kind.expected in message, message


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"])
@pytest.mark.parametrize("bad", ["-1", "1.5", "abc"])
def test_a_bad_otlp_timeout_stops_start_up_naming_the_variable(variable, bad):
    with pytest.raises(s.SettingError, match=re.escape(f"{variable}={bad!r}") + ".*whole number >= 0"):
        config_from_args(["--export-endpoint", "http://c:4317"], environ={variable: bad})


def test_a_bad_standard_variable_is_no_reason_to_stop_when_nothing_reads_it():
    shared = {"OTEL_EXPORTER_OTLP_TIMEOUT": "5s", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    assert config_from_args([], environ=shared)[0].export is None  # no push: the variables are someone else's
    with pytest.raises(s.SettingError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        config_from_args(["--export-endpoint", "http://c:4317"], environ=shared)
    with pytest.raises(s.SettingError, match="TRACEML_PROCESSOR_EXPORT_INTERVAL='5s'"):  # our own: always judged
        config_from_args([], environ={"TRACEML_PROCESSOR_EXPORT_INTERVAL": "5s"})


def test_a_bad_otlp_protocol_stops_start_up_naming_the_variable():
    with pytest.raises(s.SettingError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'.*grpc, http/protobuf"):
        config_from_args(["--export-endpoint", "http://c:4317"], environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


@pytest.mark.slow
def test_the_command_exits_2_with_an_argparse_style_message_and_no_traceback(tmp_path):
    cases = [(["--workers", "0"], {}, "--workers '0' is invalid: expected a whole number at least 1"),
             (["--export-interval", "-1"], {}, "--export-interval '-1' is invalid: expected a number of seconds"),
             ([], {"TRACEML_PROCESSOR_MAX_RUNS": "abc"},
              "TRACEML_PROCESSOR_MAX_RUNS='abc' is invalid: expected a whole number at least 1")]
    for argv, environ, expected in cases:
        out = subprocess.run([sys.executable, "-m", "traceml.processor.cli", "--db", str(tmp_path / "x.db"), *argv],
                             capture_output=True, text=True, timeout=60,
                             env={**_clean_environ(), **environ})
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith("usage: traceml-processor") and f"traceml-processor: error: {expected}" in out.stderr
        assert "Traceback" not in out.stderr
        assert not (tmp_path / "x.db").exists()  # refused before anything started


def _clean_environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("TRACEML_PROCESSOR_", "OTEL_EXPORTER_OTLP"))}


def test_code_constructing_a_config_meets_the_same_ranges():
    with pytest.raises(s.SettingError, match=r"ProcessorConfig.workers=0 is invalid: expected a whole number at least 1"):
        ProcessorConfig(db=pathlib.Path("x.db"), workers=0)
    with pytest.raises(s.SettingError, match="ProcessorConfig.idle_timeout_s=0"):
        ProcessorConfig(db=pathlib.Path("x.db"), idle_timeout_s=0)
    from traceml.processor.http_front import HttpLimits

    with pytest.raises(s.SettingError, match="HttpLimits.header_timeout_s=0"):
        HttpLimits(header_timeout_s=0).validate()


# --- precedence: flag > variable > default ------------------------------------------------


@pytest.mark.parametrize("setting", [x for x in s.SETTINGS if x.flag and x.variable], ids=lambda x: x.name)
def test_a_flag_wins_over_its_variable_which_wins_over_the_default(setting):
    if isinstance(setting.kind, s.Number):
        from_flag, from_variable = _good_values(setting)
    elif isinstance(setting.kind, s.Address):
        from_flag, from_variable = "127.0.0.1:5001", "0.0.0.0:5002"
    elif isinstance(setting.kind, s.Choice):
        from_flag, from_variable = [c for c in setting.kind.choices if c != setting.default][:2]
    else:
        from_flag, from_variable = "flag-value", "variable-value"
    both = s.resolve({setting.name: from_flag}, {setting.variable: from_variable})
    assert both[setting] == setting.kind.parse(from_flag) and both.source(setting) == setting.flag
    variable = s.resolve({}, {setting.variable: from_variable})
    assert variable[setting] == setting.kind.parse(from_variable) and variable.source(setting) == setting.variable
    neither = s.resolve({}, {setting.variable: "  "})  # empty counts as unset
    assert neither[setting] == setting.default and neither.source(setting) == "default"
    assert setting.kind.parse(from_flag) != setting.default and setting.kind.parse(from_variable) != setting.default


def test_the_otlp_variables_follow_the_one_precedence_rule():
    both = {"OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "2500", "OTEL_EXPORTER_OTLP_TIMEOUT": "4000",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    config, _ = config_from_args(["--export-endpoint", "http://c:4317"], environ=both)
    assert (config.export.timeout_s, config.export.protocol) == (2.5, "http/protobuf")
    generic = {"OTEL_EXPORTER_OTLP_TIMEOUT": "4000", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    config, _ = config_from_args(["--export-endpoint", "http://c:4317"], environ=generic)
    assert (config.export.timeout_s, config.export.protocol) == (4.0, "http/protobuf")
    config, _ = config_from_args(["--export-endpoint", "http://c:4317", "--export-protocol", "grpc"], environ=generic)
    assert config.export.protocol == "grpc"  # the flag wins
    config, _ = config_from_args(["--export-endpoint", "http://c:4317"], environ={})
    assert (config.export.timeout_s, config.export.protocol) == (s.EXPORT_TIMEOUT.default, "grpc")


def test_the_processor_endpoint_wins_and_off_turns_the_push_off_whatever_the_standard_variables_say():
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert config_from_args([], environ=otel)[0].export.endpoint is None  # on, the exporter reads the variable
    assert config_from_args([], environ={**otel, "TRACEML_PROCESSOR_EXPORT_ENDPOINT": "off"})[0].export is None
    assert config_from_args(["--export-endpoint", "off"], environ=otel)[0].export is None
    assert config_from_args([], environ={})[0].export is None


# --- what 0 means -------------------------------------------------------------------------


def test_an_otlp_timeout_of_0_is_no_limit_as_the_specification_and_the_exporter_read_it():
    config, _ = config_from_args(["--export-endpoint", "http://c:4317"], environ={"OTEL_EXPORTER_OTLP_TIMEOUT": "0"})
    assert config.export.timeout_s == env_values.NO_LIMIT_MS / 1000.0
    from traceml.exporter.settings import resolve_settings

    exporter = resolve_settings("http://c:4317", environ={"OTEL_EXPORTER_OTLP_TIMEOUT": "0",
                                                          "OTEL_METRIC_EXPORT_TIMEOUT": "0"})
    assert exporter.metrics.timeout_s == config.export.timeout_s  # the same reading on both sides


def test_rank_series_top_k_0_is_accepted_and_means_the_named_ranks_only():
    assert config_from_args(["--rank-series-top-k", "0"], environ={})[0].rank_series_top_k == 0
    assert "0: only those named ranks" in s.RANK_SERIES_TOP_K.accepted


@pytest.mark.parametrize("flag", ["--workers", "--max-runs", "--idle-timeout", "--refresh-interval",
                                  "--export-interval", "--max-ranks-per-run", "--max-series",
                                  "--max-concurrent-requests", "--http-header-timeout", "--http-max-connections"])
def test_0_is_an_error_where_the_docs_give_it_no_meaning(flag):
    with pytest.raises(s.SettingError, match=re.escape(f"{flag} '0' is invalid")):
        config_from_args([flag, "0", "--export-endpoint", "http://c:4317"], environ={})


@pytest.mark.slow
def test_stop_stays_bounded_when_the_push_timeout_is_no_limit(tmp_path):
    """A destination that accepts and never answers, with `OTEL_EXPORTER_OTLP_TIMEOUT=0`: stop() returns."""
    import socket

    from traceml.processor.summary_export import IN_FLIGHT_PUSH_BOUND_S, SummaryPusher

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        config, _ = config_from_args(
            ["--export-endpoint", f"http://127.0.0.1:{silent.getsockname()[1]}", "--export-protocol",
             "http/protobuf", "--export-interval", "0.1"], environ={"OTEL_EXPORTER_OTLP_TIMEOUT": "0"})
        from traceml.processor.metric_point import MetricPoint

        pusher = SummaryPusher(config.export, collect=lambda: [MetricPoint("traceml.processor.export.failures", {}, 0.0)],
                               resource=None)
        pusher.start()
        time.sleep(0.5)  # a push is now waiting on the silent destination
        started = time.monotonic()
        pusher.stop()
        assert time.monotonic() - started < IN_FLIGHT_PUSH_BOUND_S + 2 + 3  # no second push on the stuck one
    finally:
        silent.close()


# --- derived: help, config defaults, documentation -------------------------------------------


def test_every_flag_and_its_help_come_from_its_declaration():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    declared = [x for x in s.SETTINGS if x.flag]
    for setting in declared:
        action = actions[setting.name]
        assert action.option_strings == [setting.flag] and action.help == setting.help_text()
        assert f"default {setting.default_text}" in action.help
    assert set(actions) - {x.name for x in declared} == {"help", "version"}
    epilog = parser.epilog
    for setting in (x for x in s.SETTINGS if not x.flag):
        assert " / ".join(setting.variables) in epilog and setting.help_text(variables=False) in epilog


def test_nothing_given_builds_the_config_code_gets_by_default():
    from dataclasses import fields

    from_cli, _ = config_from_args([], environ={})
    in_code = ProcessorConfig(db=from_cli.db)
    assert from_cli.db == s.DB.default
    for field in fields(ProcessorConfig):
        if field.name not in ("auth", "tls"):
            assert getattr(from_cli, field.name) == getattr(in_code, field.name), field.name
    assert not from_cli.auth.enabled and not from_cli.tls.enabled


def _table(doc: str, header: str) -> list[list[str]]:
    start = doc.index(header)
    rows = doc[start:doc.index("\n\n", start)].splitlines()[2:]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]


def test_the_processor_docs_table_states_every_setting_as_declared():
    rows = _table((ROOT / "docs" / "processor.md").read_text(), "| flag | environment | default | accepted |")
    for setting in s.SETTINGS:
        flag_cell = "" if not setting.flag else f"`{setting.flag} {setting.metavar}`" if setting.metavar \
            else f"`{setting.flag}`"
        env_cell = ", else ".join(f"`{v}`" for v in setting.variables)
        matching = [r for r in rows if r[0] == flag_cell and r[1] == env_cell]
        assert len(matching) == 1, (setting.name, flag_cell, env_cell)
        assert matching[0][2].strip("`") == setting.default_text, setting.name
        assert matching[0][3] == setting.accepted, setting.name
    documented_flags = {m.group(1) for r in rows for m in [re.match(r"`(--[a-z-]+)", r[0])] if m}
    assert documented_flags == {x.flag for x in s.SETTINGS if x.flag} | {"--version"}


def test_the_configuration_page_gives_every_processor_variable_its_declared_default():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for setting in (x for x in s.SETTINGS if x.variable):
        row = re.search(rf"^\|[^|]*`{setting.variable}`[^|]*\| ([^|]+) \|", doc, re.M)
        assert row, setting.variable
        assert row.group(1).strip().strip("`") == setting.default_text, setting.variable


# --- one owner: no processor or launcher module restates a default ----------------------------

ALIASES = {  # the names under which each setting's value travels through the code
    s.IDLE_TIMEOUT: {"idle_timeout_s"},
    s.REFRESH_INTERVAL: {"refresh_interval_s"},
    s.EXPORT_INTERVAL: {"interval_s", "export_interval_s"},
    s.EXPORT_TIMEOUT: {"SummaryExportConfig.timeout_s", "export_timeout_s", "default_s"},
    s.MAX_RUNS: {"max_runs"},
    s.MAX_RANKS_PER_RUN: {"max_ranks_per_run"},
    s.WORKERS: {"workers"},
    s.RANK_SERIES_TOP_K: {"rank_series_top_k", "top_k", "DEFAULT_RANK_SERIES_TOP_K"},
    s.MAX_SERIES: {"max_series", "DEFAULT_MAX_SERIES"},
    s.MAX_CONCURRENT_REQUESTS: {"max_concurrent_requests", "DEFAULT_MAX_CONCURRENT_REQUESTS"},
    s.HTTP_HEADER_TIMEOUT: {"header_timeout_s", "DEFAULT_HEADER_TIMEOUT_S"},
    s.HTTP_BODY_TIMEOUT: {"body_timeout_s", "DEFAULT_BODY_TIMEOUT_S"},
    s.HTTP_BODY_CHUNK_TIMEOUT: {"body_chunk_timeout_s"},
    s.HTTP_KEEPALIVE_TIMEOUT: {"keepalive_timeout_s", "DEFAULT_KEEPALIVE_TIMEOUT_S"},
    s.HTTP_MAX_CONNECTIONS: {"max_connections", "DEFAULT_MAX_CONNECTIONS"},
}


def restated_defaults(files: list[pathlib.Path], root: pathlib.Path) -> list[tuple[str, int, str]]:
    """(file, line, setting) wherever a declared numeric default is written out again as a literal.

    Three forms: a parameter, field or module constant named for the setting
    whose default is the literal; a call that names the setting's flag or
    variable and passes the literal (`_env(VAR, "300")`); a string that names the
    flag or variable and says `default <literal>` (a hand-written help text).
    """
    table = [(x.name, aliases, x.default, tuple(m for m in (x.flag, *x.variables) if m))
             for x, aliases in ALIASES.items()]
    table += [("max_pending_records", {"max_pending_records"}, s.MAX_PENDING_RECORDS, ()),
              ("grpc_threads", {"grpc_workers", "workers"}, s.GRPC_THREADS, ())]

    def text_of(value) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)

    def literal(node, value) -> bool:
        if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
            return False
        if isinstance(node.value, str):
            return node.value.strip() == text_of(value)
        return isinstance(node.value, (int, float)) and node.value == value

    found = []
    for path in files:
        source = path.read_text()
        tree = ast.parse(source)
        data = source.encode()
        starts = [0]  # byte offset of each line, as ast's col_offset counts (get_source_segment re-splits per call)
        for line in data.splitlines(keepends=True):
            starts.append(starts[-1] + len(line))

        def segment_of(node) -> str:
            begin, end = starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset
            return data[begin:end].decode(errors="replace")

        for node in ast.walk(tree):
            named = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                positional = a.posonlyargs + a.args
                named += zip([x.arg for x in positional[len(positional) - len(a.defaults):]], a.defaults)
                named += [(x.arg, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                named.append((node.target.id, node.value))
            elif isinstance(node, ast.Assign):
                named += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.ClassDef):
                named += [(f"{node.name}.{item.target.id}", item.value) for item in node.body
                          if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value]
            is_text = isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))
            segment = segment_of(node) if isinstance(node, ast.Call) or is_text else ""
            for name, aliases, value, markers in table:
                hits = [d for arg, d in named if arg in aliases and literal(d, value)]
                if isinstance(node, ast.Call) and any(m in segment for m in markers):
                    hits += [arg for arg in node.args if literal(arg, value)]
                if is_text and any(m in segment for m in markers) and \
                        re.search(rf"default {re.escape(text_of(value))}(?![\d.])", segment):
                    hits.append(node)
                found += [(path.relative_to(root).as_posix(), hit.lineno, name) for hit in hits]
    return sorted(set(found))


@pytest.mark.slow
def test_no_processor_or_launcher_module_restates_a_default():
    files = sorted(p for folder in ("processor", "launcher") for p in (ROOT / folder).rglob("*.py")
                   if p != ROOT / "processor" / "settings.py")
    assert len(files) > 50
    assert restated_defaults(files, ROOT) == []


def test_the_restatement_finder_finds_each_form(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os\n"
        "def monitor(idle_timeout_s: float = 300.0, *, max_runs=1000):\n    pass\n"
        "class Config:\n    timeout_s: float = 10.0\nclass SummaryExportConfig:\n    timeout_s: float = 10.0\n"
        "HELP = f\"end a run (env {os.environ}TRACEML_PROCESSOR_IDLE_TIMEOUT; default 300)\"\n"
        "workers = int(os.environ.get('TRACEML_PROCESSOR_WORKERS', '1'))\n"
        "replace_with = dict(workers=1)\n")
    assert [(line, name) for _f, line, name in restated_defaults([planted], tmp_path)] == [
        (2, "idle_timeout_s"), (2, "max_runs"), (7, "export_timeout_s"), (8, "idle_timeout_s"), (9, "workers")]


# --- a missing library capability degrades with a message, not a traceback -------------------


def test_an_http_exporter_without_max_export_batch_size_is_used_unsplit_with_a_warning(monkeypatch, caplog):
    from opentelemetry.exporter.otlp.proto.http import metric_exporter

    from traceml.processor.summary_export import SummaryExportConfig, make_metric_exporter

    current = metric_exporter.OTLPMetricExporter

    class OlderExporter(current):  # the signature of the releases before the argument existed
        def __init__(self, endpoint=None, certificate_file=None, client_key_file=None, client_certificate_file=None,
                     headers=None, timeout=None, compression=None, session=None,
                     preferred_temporality=None, preferred_aggregation=None):
            super().__init__(endpoint=endpoint, headers=headers, timeout=timeout)

    monkeypatch.setattr(metric_exporter, "OTLPMetricExporter", OlderExporter)
    with caplog.at_level(logging.WARNING, logger="traceml.processor.summary_export"):
        exporter = make_metric_exporter(SummaryExportConfig("http://127.0.0.1:9", protocol="http/protobuf"))
    assert isinstance(exporter, OlderExporter)
    [record] = caplog.records
    assert "opentelemetry-exporter-otlp-proto-http" in record.getMessage()
    assert "max_export_batch_size" in record.getMessage()
    monkeypatch.setattr(metric_exporter, "OTLPMetricExporter", current)
    exporter = make_metric_exporter(SummaryExportConfig("http://127.0.0.1:9", protocol="http/protobuf"))
    assert exporter._max_export_batch_size is not None  # the installed one splits


def test_a_missing_exporter_package_is_a_start_up_error_naming_it(monkeypatch):
    from traceml.processor.summary_export import SummaryExportConfig, make_metric_exporter

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.metric_exporter", None)
    with pytest.raises(RuntimeError, match="needs opentelemetry-exporter-otlp-proto-http"):
        make_metric_exporter(SummaryExportConfig("http://127.0.0.1:9", protocol="http/protobuf"))
