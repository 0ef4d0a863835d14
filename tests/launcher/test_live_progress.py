"""Progress the live view adds to the session's result: latest step and wall-clock throughput."""
from traceml.launcher.live import ProgressMeter


def test_rate_is_steps_advanced_over_elapsed_time():
    meter = ProgressMeter()
    assert meter.observe(None, now=0.0).steps_per_s is None
    assert meter.observe(10, now=0.0).steps_per_s is None  # one point: no rate yet
    progress = meter.observe(30, now=2.0)
    assert progress.latest_step == 30 and progress.steps_per_s == 10.0


def test_a_stall_makes_the_rate_decay():
    meter = ProgressMeter()
    meter.observe(0, now=0.0)
    assert meter.observe(10, now=1.0).steps_per_s == 10.0
    # The step stays at 10 while time passes: 10 steps over 5 s.
    assert meter.observe(10, now=5.0).steps_per_s == 2.0


def test_old_points_leave_the_horizon():
    meter = ProgressMeter(horizon_s=10.0)
    meter.observe(0, now=0.0)
    meter.observe(100, now=1.0)  # fast start
    meter.observe(110, now=20.0)
    rate = meter.observe(120, now=21.0).steps_per_s
    assert rate == 10.0  # only the last 10 s count
