"""The web view's request handler on real scenario databases: routes, assets, the token, escaping, size.

`WebApp.handle` is called directly (it is framework independent); tests/web/test_ui_server.py
drives the same handler through the processor's `--ui` server over real sockets.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.step_time.scenarios import BASE
from traceml.processor.security import BearerAuth
from traceml.processor.sqlite_writer import StepTimeStore
from traceml.processor.step_time.model import RankIdentity, RawEventValue, StepTimeIngestRecord
from traceml.processor.web.app import COOKIE_NAME, WebApp
from traceml.processor.web.assets import ASSETS
from traceml.processor.web.feed import RunFeed
from traceml.processor.web.pages import script_json
from traceml.processor.web.view import MAX_DRAWN_RANKS, bounded
from traceml.schema.vocabulary import RAW_BACKWARD, RAW_DATALOADER_NEXT, RAW_STEP_TIME

HOSTILE = "run\"'<script>window.__pwned=1</script>&amp;\u2028"


def write_run(db: Path, run_id: str, ranks: int, steps: range, slow_rank: int | None = None,
              hostname: str = "node0") -> Path:
    """`steps` of `ranks` ranks of the contract's base payload (CPU clock). `slow_rank` waits 50 ms
    more for input and the others 50 ms more in backward (DDP's all-reduce waits for it)."""
    with StepTimeStore(db) as store:
        batch = []
        for step in steps:
            for rank in range(ranks):
                extra = {} if slow_rank is None else (
                    {RAW_DATALOADER_NEXT: 50.0} if rank == slow_rank else {RAW_BACKWARD: 50.0, RAW_STEP_TIME: 50.0})
                events = {k: RawEventValue(v + extra.get(k, 0.0), None, 1) for k, v in BASE.items()}
                batch.append(StepTimeIngestRecord(run_id, RankIdentity(rank, 0, 0, ranks, ranks, hostname), step,
                                                  1.7e9 + step, 1.7e9 + step + 0.1, events, "ddp"))
        store.write(batch, [])
    return db


def get(app: WebApp, path: str, query: str = "", **headers: str):
    return app.handle("GET", path, query, headers)


@pytest.fixture
def straggler_db(tmp_path) -> Path:
    return write_run(tmp_path / "t.db", "r1", 4, range(30), slow_rank=2)


def test_pages_and_json_of_a_run(straggler_db):
    app = WebApp(RunFeed(straggler_db))
    index = get(app, "/ui/")
    assert index.status == 200 and b'href="/ui/run?id=r1"' in index.body
    page = get(app, "/ui/run", "id=r1")
    assert page.status == 200 and dict(page.headers)["Content-Type"].startswith("text/html")
    body = page.body.decode()
    assert 'data-testid="culprit-rank">rank 2<' in body
    assert body.count('<g class="bar') == 4 and body.count('class="line') >= 4
    data = json.loads(get(app, "/ui/api/run", "id=r1").body)
    assert data["view"]["hero"]["kind"] == "INPUT_STRAGGLER" and data["view"]["hero"]["culprit_rank"] == 2
    assert set(data["html"]) >= {"tm-hero", "tm-rail", "tm-phases", "tm-steps", "tm-telemetry"}
    assert "no-store" in dict(page.headers)["Cache-Control"]
    assert "script-src 'self'" in dict(page.headers)["Content-Security-Policy"]
    assert get(app, "/ui", "").status == 308


def test_unknown_run_routes_and_methods(straggler_db):
    app = WebApp(RunFeed(straggler_db))
    early = get(app, "/ui/run", "id=not-yet")  # a run whose data has not arrived: a page that waits for it
    assert early.status == 200 and b"no data stored for this run yet" in early.body
    assert json.loads(get(app, "/ui/api/run", "id=not-yet").body)["view"]["freshness"]["state"] == "cold"
    assert get(app, "/ui/api/run").status == 404
    assert get(app, "/ui/run").status == 404
    assert get(app, "/ui/elsewhere").status == 404
    assert get(app, "/metrics").status == 404
    assert app.handle("POST", "/ui/", "", {}).status == 405
    head = app.handle("HEAD", "/ui/", "", {})
    assert head.status == 200 and head.body == b""


@pytest.mark.parametrize("path", [
    "/ui/assets/../assets.py", "/ui/assets/..%2F..%2Fetc%2Fpasswd", "/ui/assets/%2e%2e/app.py",
    "/ui/assets//etc/passwd", "/ui/assets/style.css/../../../etc/passwd", "/ui/assets/",
    "/ui/assets/__init__.py", "/ui/../etc/passwd", "/ui/assets/STYLE.CSS",
])
def test_only_the_named_assets_are_served(straggler_db, path):
    app = WebApp(RunFeed(straggler_db))
    answer = get(app, path)
    assert answer.status == 404 and b"root:" not in answer.body and b"import" not in answer.body


def test_assets_are_served_with_their_types(straggler_db):
    app = WebApp(RunFeed(straggler_db))
    for name, (ctype, content) in ASSETS.items():
        answer = get(app, f"/ui/assets/{name}")
        assert answer.status == 200 and answer.body == content and dict(answer.headers)["Content-Type"] == ctype


def test_the_token_as_header_query_then_cookie(straggler_db):
    app = WebApp(RunFeed(straggler_db), auth=BearerAuth("s3cret"), secure=True)
    assert get(app, "/ui/").status == 401
    assert get(app, "/ui/api/run", "id=r1").status == 401
    assert get(app, "/ui/assets/app.js").status == 401
    assert get(app, "/ui/", authorization="Bearer wrong").status == 401
    assert get(app, "/ui/", authorization="Bearer s3cret").status == 200
    assert get(app, "/ui/run", "id=r1&token=wrong").status == 401
    login = get(app, "/ui/run", "id=r1&token=s3cret")
    headers = dict(login.headers)
    assert login.status == 303 and headers["Location"] == "/ui/run?id=r1"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" in cookie and "Path=/ui" in cookie
    value = cookie.split(";")[0]
    assert "s3cret" not in value  # a keyed hash of the token, never the token
    assert get(app, "/ui/api/run", "id=r1", cookie=f"other=1; {value}").status == 200
    assert get(app, "/ui/api/run", "id=r1", cookie=f"{COOKIE_NAME}=forged").status == 401


def test_a_hostile_run_id_and_hostname_are_text_everywhere(tmp_path):
    db = write_run(tmp_path / "h.db", HOSTILE, 2, range(25), slow_rank=1, hostname="<img src=x onerror=alert(1)>")
    app = WebApp(RunFeed(db))
    from urllib.parse import quote

    for answer in (get(app, "/ui/"), get(app, "/ui/run", f"id={quote(HOSTILE)}")):
        body = answer.body.decode()
        assert answer.status == 200
        assert "<script>window" not in body and "<img" not in body
        assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in body
        assert "run&quot;&#x27;" in body
    data = json.loads(get(app, "/ui/api/run", f"id={quote(HOSTILE)}").body)
    assert data["view"]["run_id"] == HOSTILE
    assert all("<script>window" not in fragment for fragment in data["html"].values())


def test_script_json_cannot_close_its_element():
    text = script_json({"a": "</script><script>x()</script>", "b": "&<>\u2028\u2029"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert "\u2028" not in text and "\u2029" not in text
    assert json.loads(text) == {"a": "</script><script>x()</script>", "b": "&<>\u2028\u2029"}


def test_every_page_shares_one_refresh_per_tick(straggler_db):
    """Ten pages at once on one run: one session refresh, one analysis; the next tick one more."""
    now = [0.0]
    feed = RunFeed(straggler_db, tick_s=1.0, clock=lambda: now[0])
    app = WebApp(feed)
    barrier = threading.Barrier(10)
    bodies = []

    def page():
        barrier.wait()
        bodies.append(get(app, "/ui/api/run", "id=r1").body)

    threads = [threading.Thread(target=page) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    session = feed._session("r1")
    assert len(bodies) == 10 and len(set(bodies)) == 1
    assert feed.refreshes == 1 and session.analyses == 1
    now[0] = 0.5
    get(app, "/ui/api/run", "id=r1")
    assert feed.refreshes == 1
    write_run(straggler_db, "r1", 4, range(30, 32), slow_rank=2)
    now[0] = 1.5
    view = json.loads(get(app, "/ui/api/run", "id=r1").body)["view"]
    assert feed.refreshes == 2 and session.analyses == 2 and view["window"]["last_step"] == 31


@pytest.mark.slow
def test_the_json_is_bounded_by_what_is_drawn(tmp_path):
    small = write_run(tmp_path / "s.db", "many", 40, range(30), slow_rank=7)
    large = write_run(tmp_path / "l.db", "many", 400, range(30), slow_rank=7)
    sizes = {}
    for label, db in (("small", small), ("large", large)):
        answer = get(WebApp(RunFeed(db)), "/ui/api/run", "id=many")
        data = json.loads(answer.body)
        view = data["view"]
        assert len(view["phases"]) == MAX_DRAWN_RANKS and len(view["steps"]["by_rank"]) == MAX_DRAWN_RANKS
        assert 7 in view["ranks"]["drawn"]  # the culprit is always drawn
        assert view["ranks"]["not_drawn"] == view["ranks"]["total"] - MAX_DRAWN_RANKS
        assert "ranks not drawn" in data["html"]["tm-phases"]
        sizes[label] = len(answer.body)
    assert sizes["large"] < 1.25 * sizes["small"], sizes  # ten times the ranks, about the same size


def test_bounded_lists_and_maps():
    assert bounded(list(range(3))) == [0, 1, 2]
    assert bounded(list(range(40)), 4) == {"items": [0, 1, 2, 3], "total": 40}
    assert bounded({str(i): i for i in range(6)}, 4) == {"items": {"0": 0, "1": 1, "2": 2, "3": 3}, "total": 6}
    assert bounded({"x": list(range(5))}, 2) == {"x": {"items": [0, 1], "total": 5}}


def test_per_step_peak_memory_is_drawn_when_present(tmp_path):
    from traceml.processor.step_time.model import StepMemoryIngestRecord

    db = write_run(tmp_path / "m.db", "mem", 2, range(25), slow_rank=1)
    with StepTimeStore(db) as store:
        store.write((), [StepMemoryIngestRecord("mem", rank, step, "cuda:0", (1 + rank) * 2**30 + step * 2**20,
                                                3 * 2**30, 1.7e9 + step) for rank in (0, 1) for step in range(25)])
    data = json.loads(get(WebApp(RunFeed(db)), "/ui/api/run", "id=mem").body)
    memory = data["view"]["memory"]
    assert memory["available"] and memory["peak_allocated_bytes"] == {"value": 2 * 2**30 + 24 * 2**20, "rank": 1}
    assert memory["steps_by_rank"]["1"][-1] == 2 * 2**30 + 24 * 2**20
    assert data["html"]["tm-memory"].count('class="line') == 2 and "memory-chart" in data["html"]["tm-memory"]


def test_the_feed_forgets_runs_nobody_views(straggler_db, monkeypatch):
    from traceml.processor.web import feed as feed_module
    from traceml.processor.web.feed import MAX_OWN_SESSIONS

    monkeypatch.setattr(feed_module, "MAX_INDEX_RUNS", 5)
    MAX_INDEX_RUNS = 5
    now = [0.0]
    feed = RunFeed(straggler_db, clock=lambda: now[0])
    for i in range(4 * MAX_INDEX_RUNS + 5):
        now[0] += 1.0
        feed.run_view(f"absent-{i}")
    assert len(feed._run_locks) <= 4 * MAX_INDEX_RUNS + 1 and len(feed._cache) <= 4 * MAX_INDEX_RUNS + 1
    assert len(feed._own) == MAX_OWN_SESSIONS
