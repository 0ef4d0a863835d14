"""The live view's resource lines: the card's own lines, from the same analysis; wire strings escaped."""
from __future__ import annotations

import dataclasses

from harness.resource_windows import busy_gpu_run
from tests.step_time.test_live_presenter import result_of, straggler_window, text_of
from traceml.processor.presenters import format_live_line, render_live
from traceml.processor.reporting import RunMetadata, project_final_summary
from traceml.processor.reporting.resources import resource_lines

HOSTILE = "[bold red]gpu-host[/]\x1b[2J\x9b1m"


def with_resources(result, resources):
    return dataclasses.replace(result, analysis=dataclasses.replace(result.analysis, resources=resources))


def test_the_live_panel_shows_the_cards_resource_lines():
    result = with_resources(result_of(straggler_window()), busy_gpu_run("run-test"))
    text = text_of(render_live(result), width=400)
    card = project_final_summary(result.analysis, RunMetadata("run-test"))["card"]
    lines = resource_lines(project_final_summary(result.analysis, RunMetadata("run-test"))["resources"])
    assert len(lines) == 4
    for line in lines:
        assert line.strip() in text and line in card
    assert "GPU util median 62% (r1), worst 12% (r2)" in text


def test_the_plain_line_carries_median_and_worst_of_cpu_rss_gpu_and_host_cpu():
    result = with_resources(result_of(straggler_window()), busy_gpu_run("run-test"))
    line = format_live_line(result, steps_per_s=1.0)
    assert line.endswith("| step 140.0 ms (worst 140.0 (r0)) | cpu 45%/98% r1 | rss 2.5 GiB/3.5 GiB r1 "
                         "| gpu 62%/12% r2 | host cpu 68%/97% node-b | 1.00 steps/s")


def test_without_resource_data_the_panel_says_so_and_the_plain_line_is_unchanged():
    result = result_of(straggler_window())
    assert "Resources: not measured" in text_of(render_live(result))
    assert "cpu" not in format_live_line(result)


def test_a_hostile_host_name_is_shown_as_typed_never_as_markup_or_control():
    result = with_resources(result_of(straggler_window()), busy_gpu_run("run-test", hostile_host=HOSTILE))
    text = text_of(render_live(result), width=400)
    assert "[bold red]gpu-host[/]\\x1b[2J\\x9b1m" in text
    assert "\x1b" not in text and "\x9b" not in text
    line = format_live_line(result)
    assert "\x1b" not in line and "[bold red]gpu-host[/]\\x1b[2J\\x9b1m" in line
