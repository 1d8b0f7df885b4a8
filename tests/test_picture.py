"""The timeline picture: what it draws (lanes, phases, speed windows, stalls, waits), the files
it writes (self-contained HTML, PNG, SVG), the CLI command, and the page in a real Chromium."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from slotscope import picture as pic
from slotscope.analyze import Options
from slotscope.analyze.stalls import worst_stalls
from slotscope.analyze.waits import worst_waits
from slotscope.cli import app
from slotscope.dataset import Dataset, load
from slotscope.report import setup_line

from .conftest import REAL, ROOT

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium") if p and os.path.exists(p)), None)
DOCS_SHOT = ROOT / "docs" / "timeline.png"


@lru_cache(maxsize=None)
def _ds(scenario: str, server_only: bool = False) -> Dataset:
    return load([REAL / scenario / "logs" / ("llama-server.log" if server_only else "")])


@lru_cache(maxsize=None)
def _data(scenario: str, server_only: bool = False) -> pic.TimelineData:
    return pic.timeline_data(_ds(scenario, server_only))


def test_one_lane_per_slot_on_the_wall_clock() -> None:
    d = _data("before")
    assert list(d.lanes["label"]) == ["slot 0", "slot 1", "slot 2", "slot 3"]
    assert d.wall and d.overview is None
    assert len(d.tasks) == 45 and d.tasks["lane"].notna().all()
    # Wall-clock milliseconds: the first task (task 0) launched at 07:31:47.964 UTC (app-aligned).
    t0 = d.tasks.loc[d.tasks["task"] == 0].iloc[0]
    assert pd.Timestamp(int(t0["l"]), unit="ms", tz="UTC") == pd.Timestamp("2026-11-29T07:31:47.964Z")
    assert t0["purpose"] == "chat" and t0["where"] == "llama-server.log:11"


def test_phases_follow_each_other_and_queue_comes_from_the_app_log() -> None:
    t = _data("before").tasks
    for a, b in (("q", "l"), ("l", "p"), ("p", "f"), ("f", "r")):
        ok = t[a].notna() & t[b].notna()
        assert (t.loc[ok, b].astype(float) >= t.loc[ok, a].astype(float)).all()
    assert t["q"].notna().all()  # every call of `before` has a queue time in app.jsonl
    assert _data("before", server_only=True).tasks["q"].isna().all()


def test_speed_windows_are_the_heartbeat_windows_at_their_exact_speed() -> None:
    ds, d = _ds("before"), _data("before")
    gs = ds.server.gen_samples
    hb = d.speed[d.speed["where"].str.startswith("llama-server.log:")]
    assert len(hb) == len(gs)
    # Task 309's first window: first token .. the heartbeat at line 47, 99 tokens in 41.2 s.
    w = hb[(hb["task"] == 309) & (hb["where"] == "llama-server.log:47")].iloc[0]
    assert w["n"] == 99 and w["sec"] == pytest.approx(41.229, abs=1e-3)
    assert w["v"] == pytest.approx(99 / 41.229, abs=0.01)
    assert w["v"] < pic.STALL_FRAC * d.speed_top  # drawn as a stall (a dip)


def test_worst_stall_is_marked_with_the_prefill_that_caused_it() -> None:
    d = _data("before")
    top = worst_stalls(_ds("before"), Options()).iloc[0]
    s = d.stalls.iloc[0]
    assert (s["task"], s["ctask"], s["cnew"]) == (top["task_id"], top["cause_task_id"], 17306) == (309, 102, 17306)
    assert s["lane"] == 1 and s["clane"] == 2
    assert s["label"] == "stall #1: 0.25 tok/s"
    assert s["ca"] <= s["cx"] <= s["cb"] and s["a"] <= s["cx"] <= s["b"]  # the link runs where both overlap
    # One stall cut by two prefills is marked once.
    assert not d.stalls.duplicated(["task", "a"]).any()


def test_longest_wait_is_marked_with_the_task_that_held_the_batch() -> None:
    d = _data("before")
    top = worst_waits(_ds("before"), Options()).iloc[0]
    w = d.waits.iloc[0]
    assert (w["task"], w["htask"], w["cause"]) == (top["task_id"], top["holder_task_id"], "different_lora") == (456, 102, "different_lora")
    assert w["label"] == "wait 61 s (held by task 102)"
    assert w["hlane"] == 2 and w["a"] <= w["hx"] <= w["b"]


def test_server_log_alone_stays_on_the_server_clock_one_lane_per_session_slot() -> None:
    d = _data("restart", server_only=True)
    assert not d.wall
    assert list(d.lanes["label"][:2]) == ["s1 slot 0", "s1 slot 1"] and len(d.lanes) == 8
    assert d.tasks["purpose"].isna().all() and d.tasks["lora"].isna().all()
    assert any("server-clock seconds" in n for n in d.notes)


def test_since_until_keep_the_tasks_launched_in_the_window() -> None:
    ds = _ds("wallclock")
    d = pic.timeline_data(ds, since="120", until="300")
    tv_launch = ds.tasks["launch_s"]
    assert len(d.tasks) == int(((tv_launch >= 120) & (tv_launch < 300)).sum()) > 0
    d2 = pic.timeline_data(ds, since=pd.Timestamp("2026-11-29T08:03:00Z"), until=pd.Timestamp("2026-11-29T08:05:00Z"))
    assert 0 < len(d2.tasks) < len(_data("wallclock").tasks)
    with pytest.raises(pic.NothingToDraw):
        pic.write_timeline(ds, "unused.html", since="2030-01-01")


def test_a_long_log_is_drawn_as_bins_until_zoomed_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pic, "DETAIL_MAX_TASKS", 10)
    d = pic.timeline_data(_ds("before"))
    assert d.overview is not None and d.overview_speed is not None and d.detail_span is not None
    assert d.detail_span < d.domain[1] - d.domain[0]
    # The bins hold every second of every phase (ms on the wall clock).
    t = d.tasks.astype({c: "float64" for c in "lpfr"})
    for phase, a, b, col in (("wait", "l", "p", "wait_s"), ("prefill", "p", "f", "prefill_s"), ("generation", "f", "r", "gen_s")):
        total = float((t[b] - t[a]).clip(lower=0).sum()) / 1e3
        assert d.overview[col].sum() == pytest.approx(total, rel=0.01, abs=1.0), phase
    assert (d.overview["busy"] <= 1).all()
    spec, datasets = pic.timeline_spec(d)
    assert {"overview", "overview_speed"} <= set(datasets)
    text = str(spec)
    assert "zoom.a" in text and f"{d.detail_span:.10g}" in text
    # A static image cannot zoom: it shows the bins only.
    static, _ = pic.timeline_spec(d, interactive=False)
    assert "zoom.a" not in str(static) and "isObject(zoom)" not in str(static)


def test_html_is_self_contained_and_small(tmp_path: Path) -> None:
    sizes = {}
    for scenario in ("after", "wallclock"):
        out = pic.timeline_html(_ds(scenario), tmp_path / f"{scenario}.html")
        text = out.read_text()
        sizes[scenario] = out.stat().st_size
        assert "vegaEmbed" in text and "<script src" not in text
        assert not re.search(r"""(src|href)=["']?https?://""", text)
        assert 'renderer: "svg"' in text
    assert max(sizes.values()) < 5_000_000


def test_static_png_and_svg(tmp_path: Path) -> None:
    png = pic.write_timeline(_ds("before"), tmp_path / "incident.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = pic.write_timeline(_ds("before"), tmp_path / "incident.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<svg") and "slot 3" in text and "stall #1: 0.25 tok/s" in text


def test_report_html_has_tables_and_timeline(tmp_path: Path) -> None:
    tables = {"findings": pd.DataFrame({"finding": ["Generation stalled <here>."]}),
              "waits": pd.DataFrame({"cause": ["different_lora"], "count": [29]})}
    out = pic.report_html(_ds("before"), tables, tmp_path / "report.html")
    text = out.read_text()
    assert "Generation stalled &lt;here&gt;." in text and 'id="table-waits"' in text and "vegaEmbed" in text
    setup = setup_line(_ds("before").server.sessions)  # its content: test_report's
    assert setup.startswith("server: model ") and html.escape(setup) in text  # as the text report's header


runner = CliRunner()


def test_cli_timeline_writes_html(tmp_path: Path) -> None:
    out = tmp_path / "incident.html"
    r = runner.invoke(app, ["timeline", str(REAL / "before" / "logs"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 100_000
    assert f"wrote {out}" in r.stderr and r.stdout == ""


def test_cli_timeline_needs_an_output_file() -> None:
    r = runner.invoke(app, ["timeline", str(REAL / "before" / "logs")])
    assert r.exit_code == 2
    assert "timeline needs -o FILE" in r.stderr


def test_cli_timeline_empty_window_is_one_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["timeline", str(REAL / "before" / "logs"), "-o", str(tmp_path / "x.html"), "--since", "2030-01-01"])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: no task was launched in the window (--since 2030-01-01")


def test_cli_timeline_help() -> None:
    r = runner.invoke(app, ["timeline", "--help"])
    assert r.exit_code == 0 and "--since" in r.stdout and ".png" in r.stdout


def _chromium(url: str, *extra: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--hide-scrollbars", *extra, url],
        capture_output=True, text=True, timeout=120, check=False)


def _assert_rendered(dom: str) -> None:
    """The page marks <body> once vega-embed has drawn, <html> on any error."""
    assert re.search(r'<body[^>]*\sdata-rendered-ms="\d+"', dom), dom[-3000:]
    assert not re.search(r"<html[^>]*\sdata-error=", dom)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_timeline_renders_in_chromium(tmp_path: Path) -> None:
    page = pic.timeline_html(_ds("before"), tmp_path / "before.html")
    r = _chromium(page.as_uri(), "--virtual-time-budget=10000", "--dump-dom", tmp=tmp_path)
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], "\n".join(console)
    dom = r.stdout
    _assert_rendered(dom)
    chart = dom[dom.index('id="timeline"'):dom.index('id="error"')]
    assert "<svg" in chart
    for lane in ("slot 0", "slot 1", "slot 2", "slot 3"):
        assert f">{lane}</text>" in chart
    # The worst stall (slot 1, task 309) and the long prefill that caused it (task 102, slot 2).
    assert ">stall #1: 0.25 tok/s</text>" in chart
    assert ">prefill of task 102 (17,306 new tokens)</text>" in chart
    assert ">wait 61 s (held by task 102)</text>" in chart

    shot = tmp_path / "timeline.png"
    r = _chromium(page.as_uri(), "--virtual-time-budget=10000", "--window-size=1240,600", f"--screenshot={shot}", tmp=tmp_path)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]
    if os.environ.get("SLOTSCOPE_UPDATE_DOCS") == "1":
        DOCS_SHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SHOT)


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install chromium)")
def test_long_log_page_renders_in_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pic, "DETAIL_MAX_TASKS", 10)
    page = pic.timeline_html(_ds("restart"), tmp_path / "long.html")
    assert 'renderer: "canvas"' in page.read_text()
    r = _chromium(page.as_uri(), "--virtual-time-budget=10000", "--dump-dom", tmp=tmp_path)
    assert [line for line in r.stderr.splitlines() if ":CONSOLE" in line] == []
    _assert_rendered(r.stdout)
    assert "<canvas" in r.stdout


def test_stall_threshold_matches_what_is_drawn_red() -> None:
    d = _data("after")
    assert len(d.stalls) and (d.stalls["v"] < pic.STALL_FRAC * d.speed_top).all()
    assert np.isfinite(d.speed_top) and d.speed_top > 10


def test_two_servers_with_the_same_task_ids_keep_their_own_stalls_and_waits(tmp_path: Path) -> None:
    """Two servers whose sessions and task ids coincide (here: one log under two names): each
    marked stall and wait is its own server's, with the one server's tokens and seconds. Once,
    stalls were joined to the tasks in view by session and task id only, and each took the
    other server's pieces too (twice the tokens and seconds)."""
    log = (REAL / "before" / "logs" / "llama-server.log").read_bytes()
    for name in ("a-server.log", "b-server.log"):
        (tmp_path / name).write_bytes(log)
    one = pic.timeline_data(load([REAL / "before" / "logs" / "llama-server.log"]))
    two = pic.timeline_data(load([tmp_path]))
    for kind in ("stalls", "waits"):
        single, double = getattr(one, kind), getattr(two, kind)
        assert len(single) and len(double) >= len(single)
        cols = ["task", "tokens", "sec"] if kind == "stalls" else ["task"]
        for src in ("a-server.log", "b-server.log"):
            mine = double[double["where"].str.startswith(src)]
            got = mine[cols].reset_index(drop=True)
            want = single[cols].head(len(mine)).reset_index(drop=True)
            pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_a_log_that_begins_mid_task_is_drawn_with_its_cut_tasks(tmp_path: Path) -> None:
    """The newest part of a rotated log begins while 4 tasks run: they have no launch line,
    so no file to point at. They are drawn, marked ``?`` (this raised a TypeError)."""
    from .conftest import FORMATS

    data = pic.timeline_data(load([FORMATS / "rotated" / "llama-server.log"]))
    cut = data.tasks[data.tasks["status"] == "cut_at_start"]
    assert len(cut) == 4 and (cut["where"] == "?:?").all()
    assert data.tasks.loc[data.tasks["status"] == "complete", "where"].str.fullmatch(r"llama-server\.log:\d+").all()
    r = runner.invoke(app, ["timeline", str(FORMATS / "rotated" / "llama-server.log"), "-o", str(tmp_path / "x.html")])
    assert r.exit_code == 0, r.stderr


def _inline_scripts(page: str) -> list[str]:
    """The contents of the page's inline script elements, cut as an HTML parser cuts them: a
    script ends at the first ``</script``, and none may hold ``<!--`` or ``<script`` (which
    would make the parser read on past that ``</script>``)."""
    return re.findall(r"<script>(.*?)</script", page, flags=re.S | re.I)


def test_purposes_with_markup_do_not_end_or_swallow_the_inline_script(tmp_path: Path) -> None:
    """A purpose (or any string of the logs) enters the page's inline JSON. `<!--<script>` in it
    once made the browser take the rest of the page as script, and the chart was never drawn."""
    logs = tmp_path / "logs"
    logs.mkdir()
    shutil.copyfile(REAL / "before" / "logs" / "llama-server.log", logs / "llama-server.log")
    purposes = ["<!--<script>", "</script><script>alert(1)</script>", "<!-- -->&</SCRIPT >"]
    lines = (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines(keepends=True)
    for i, purpose in enumerate(purposes):
        lines[i] = re.sub(r'"purpose":"[^"]*"', lambda _: '"purpose":' + json.dumps(purpose), lines[i], count=1)
    (logs / "app.jsonl").write_text("".join(lines))
    out = tmp_path / "report.html"
    r = runner.invoke(app, ["analyze", str(logs), "--html", str(out)])
    assert r.exit_code == 0, r.output
    page = out.read_text()
    scripts = _inline_scripts(page)
    assert len(scripts) == 3 == len(re.findall(r"<script", page, flags=re.I))
    for body in (scripts[0], scripts[2]):  # the error handler, and the spec with its data
        assert not re.search(r"<!--|<script|</", body, flags=re.I)
    assert not re.search(r"<!--|<script", scripts[1], flags=re.I)  # the bundle has none to escape
    data = json.loads(re.search(r"const data = (\{.*?\});\n", scripts[2], flags=re.S).group(1))  # type: ignore[union-attr]
    tasks = data["tasks"]
    seen = {row[tasks["columns"].index("purpose")] for row in tasks["data"]}
    assert set(purposes) <= seen
    assert "chat" in seen  # the other calls are untouched
    # In the tables under the chart, the same text is HTML-escaped.
    assert html.escape("<!--<script>") in page and "<!--<script>" not in page
