"""The live dashboard and /metrics: the Prometheus text parsed with the Prometheus client's own
parser, the token rule, and a real headless Chromium watching an elastic run grow and shrink."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

import tidepool  # noqa: E402
from tidepool.testing import wait_until  # noqa: E402

pytestmark = pytest.mark.integration
ARTIFACTS = Path(os.environ.get("TIDEPOOL_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts")) / "dashboard"


def work(x: int, d: float = 0.3) -> int:
    time.sleep(d)
    return x


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - loopback only
        return r.read()  # type: ignore[no-any-return]


def test_metrics_parse_with_the_prometheus_parser_and_match_the_scheduler() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with tidepool.LocalCluster(n_workers=2, dashboard=True) as cluster, tidepool.Client(cluster) as client:
        assert cluster.dashboard_link.startswith("http://127.0.0.1:")
        assert client.gather(client.map(work, range(6), [0.01] * 6)) == list(range(6))
        fams = {f.name: f for f in text_string_to_metric_families(fetch(cluster.dashboard_link + "metrics").decode())}
        for name in ("tidepool_workers", "tidepool_tasks", "tidepool_tasks_finished", "tidepool_launches",
                     "tidepool_retirements", "tidepool_tasks_recomputed", "tidepool_loop_lag_seconds"):  # fmt: skip
            assert name in fams, sorted(fams)
        workers = sum(s.value for s in fams["tidepool_workers"].samples)
        assert workers == len(cluster.workers) == 2
        finished = fams["tidepool_tasks_finished"].samples[0].value
        assert finished == cluster.scheduler.state.counters["finished"] >= 6
        def state() -> dict[str, Any]:  # the shared snapshot is at most one interval old
            return json.loads(fetch(cluster.dashboard_link + "api/state"))  # type: ignore[no-any-return]

        wait_until(lambda: state()["counters"]["finished"] >= 6, 10, "/api/state to show the finished tasks")
        view = state()
        assert {w["id"] for w in view["workers"]} == set(cluster.workers)
        assert view["groups"]["work"]["memory"] == 6
        text = fetch(cluster.dashboard_link + "metrics").decode()
        check_metric_names(text)
        # series with value 0 read 0 instead of vanishing
        assert 'tidepool_workers{node_type="default",state="busy"} 0.0' in text
        assert 'tidepool_pending_workers{node_type="default"} 0.0' in text
        assert 'tidepool_task_duration_seconds_count{group="work"} 6.0' in text
        assert 'tidepool_task_compute_seconds_total{group="work"}' in text
        assert "tidepool_tick_duration_seconds" in text and "tidepool_worker_held_bytes" in text
        assert 'tidepool_worker_memory_bytes{kind="limit",worker="' in text  # 2 workers: below the limit
        # the page's first response carries the state: it draws before any live update
        page = fetch(cluster.dashboard_link).decode()
        initial = json.loads(page.split("const INITIAL = ", 1)[1].split(";\nlet series", 1)[0])
        assert {w["id"] for w in initial["view"]["workers"]} == set(cluster.workers)
        assert initial["live"] is True


def test_a_scheduler_with_no_worker_yet_has_every_worker_series_at_zero() -> None:
    """Found by a bug hunt: before any worker joined, the worker series were missing instead of 0
    (docs/dashboard.md), so an alert on ``tidepool_workers == 0`` saw nothing."""
    with tidepool.LocalCluster(n_workers=0, dashboard=True) as cluster:
        text = fetch(cluster.dashboard_link + "metrics").decode()
    for line in ('tidepool_workers{node_type="default",state="idle"} 0.0', 'tidepool_pending_workers{node_type="default"} 0.0',
                 'tidepool_worker_held_bytes{node_type="default"} 0.0'):  # fmt: skip
        assert line in text, text


def check_metric_names(text: str) -> None:
    """Prometheus' naming rules, by the client's own parser (and promtool when installed)."""
    import re
    import subprocess

    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        assert re.fullmatch(r"tidepool_[a-z][a-z0-9_]*", fam.name), fam.name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        assert not fam.name.endswith("_total") or fam.type == "counter", fam.name
        for unit in ("_ms", "_milliseconds", "_kb", "_mb", "_minutes"):
            assert unit not in fam.name, f"{fam.name}: use base units (seconds, bytes)"
        labels = {k for s in fam.samples for k in s.labels} - {"le"}
        assert labels <= {"node_type", "state", "group", "worker", "kind"}, (fam.name, labels)  # never a task key
    promtool = shutil.which("promtool")
    if promtool:
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboard_is_on_by_default_at_8787_or_the_next_free_port_and_off_on_request() -> None:
    with tidepool.LocalCluster(n_workers=1) as one, tidepool.LocalCluster(n_workers=0) as two:
        links = {one.dashboard_link, two.dashboard_link}
        assert len(links) == 2 and all(link.startswith("http://127.0.0.1:") for link in links)
        ports = sorted(int(link.rsplit(":", 1)[1].strip("/")) for link in links)
        assert all(p >= 8787 for p in ports)  # 8787 and up (an ephemeral port once that range is busy)
        for link in links:
            assert b"tidepool_workers" in fetch(link + "metrics")
        assert one.dashboard_link in repr(one) and "1 worker (default: 1)" in repr(one)
        assert one.dashboard_link in one._repr_html_() and "<td>default</td><td>1</td>" in one._repr_html_()
        with tidepool.Client(one) as client:
            assert one.dashboard_link in repr(client) and "default: 1" in repr(client)
            assert one.dashboard_link in client._repr_html_()
            # a resource typo fails at submit, naming the close name (not after the 60 s no-worker wait)
            from tidepool.errors import InfeasibleTaskError

            with pytest.raises(InfeasibleTaskError, match="did you mean 'cpu'"):
                client.submit(abs, -1, resources={"CPU": 1}).result(timeout=30)
        assert "closed" in repr(client)
    with tidepool.LocalCluster(n_workers=0, dashboard=False) as off:
        assert off.dashboard is None and off.dashboard_link == "" and "dashboard" not in repr(off)


def test_with_tls_the_dashboard_is_https_with_the_same_certificate(tmp_path: Path) -> None:
    import ssl

    from tidepool.comm.tls import make_certs

    tls = make_certs(tmp_path)
    with tidepool.LocalCluster(n_workers=0, tls=tls) as cluster:
        assert cluster.dashboard_link.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=tls.ca)
        ctx.check_hostname = False
        with urllib.request.urlopen(cluster.dashboard_link + "metrics", timeout=10, context=ctx) as r:  # noqa: S310
            assert b"tidepool_workers" in r.read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP on that port
            fetch(cluster.dashboard_link.replace("https://", "http://") + "metrics")


def test_a_dashboard_that_needs_the_token_refuses_requests_without_it() -> None:
    from tidepool.dashboard import Dashboard

    with tidepool.LocalCluster(n_workers=0) as cluster:
        dash = cluster._loop.run(Dashboard(cluster.scheduler, lambda: None, require_token=True).start())
        try:
            with pytest.raises(urllib.error.HTTPError) as err:
                fetch(dash.address + "metrics")
            assert err.value.code == 401
            with pytest.raises(urllib.error.HTTPError):
                fetch(dash.address + "api/state?token=" + "0" * 64)
            assert b"tidepool_workers" in fetch(dash.address + "metrics?token=" + cluster.token)
            assert dash.link.endswith("?token=" + cluster.token)
        finally:
            cluster._loop.run(dash.stop())


def _browser(tmp: Path) -> Any:
    """Headless chromium whose temporary files (shared memory without /dev/shm, its profile) go
    under ``tmp``, not /tmp, where they were left behind after ``quit()``."""
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/setup-services.sh installs them)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver, env={**os.environ, "TMPDIR": str(tmp)}), options=opts)


def test_the_page_follows_an_elastic_run_in_a_real_browser(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    from tidepool.scaling.policies import Adaptive, IdleRetire

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser = _browser(tmp_path)
    try:
        with tidepool.LocalCluster(n_workers=0, dashboard=True) as cluster, tidepool.Client(cluster) as client:
            cluster.adapt(maximum=3, policy=Adaptive(idle=IdleRetire(idle_timeout=1.0, cached_idle_timeout=1.0)))
            browser.get(cluster.dashboard_link)

            def text(elem_id: str) -> str:
                return str(browser.find_element(By.ID, elem_id).text)

            wait_until(lambda: text("status") == "live", 20, "the page to connect")
            wait_until(lambda: text("workers-count") == "0", 10, "the page to show the empty pool")
            futs = client.map(work, range(30))
            wait_until(lambda: int(text("workers-count") or 0) >= 2, 30, "the page to show the pool growing")
            wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#decisions li")) >= 1, 10,
                       "a scaling decision on the page")  # fmt: skip
            assert "launch" in text("decisions")
            assert len(browser.find_elements(By.CSS_SELECTOR, "#workers .worker-row")) >= 2
            # each worker's memory bar, against its limit (the red line)
            assert len(browser.find_elements(By.CSS_SELECTOR, "#workers .worker-row .mem .lim")) >= 2
            browser.save_screenshot(str(ARTIFACTS / "growing.png"))
            assert client.gather(futs) == list(range(30))
            del futs  # nothing held any more: every worker may go
            wait_until(lambda: text("workers-count") == "0", 40, "the page to show the pool shrinking to zero")
            assert "retire" in text("decisions")
            numbers = browser.execute_script(  # read in one go: the list is redrawn as updates arrive
                "return [...document.querySelectorAll('#decisions li .n')].map(e => e.textContent)")
            assert len(numbers) == len(set(numbers)), numbers  # the first response and the stream do not overlap
            metrics = fetch(cluster.dashboard_link + "metrics").decode()
            started = [ln for ln in metrics.splitlines() if ln.startswith('tidepool_worker_startup_seconds_count{node_type="default"}')]
            arrived = [r for r in cluster.journal.records if r["kind"] == "launch-arrived"] if cluster.journal else []
            assert started and float(started[0].split()[-1]) == len(arrived), (started, arrived)  # measured start-ups
            assert 'tidepool_workers{node_type="default",state="idle"} 0.0' in metrics  # 0 reads 0
            assert int(text("tasks-done")) >= 30
            assert browser.find_elements(By.CSS_SELECTOR, "#stream rect")  # the task stream drew the tasks
            browser.save_screenshot(str(ARTIFACTS / "after.png"))
        errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
        errors = [e for e in errors if "api/stream" not in e.get("message", "")]  # the stream ends with the cluster
        assert not errors, errors
    finally:
        browser.quit()


def test_without_the_extra_the_error_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import threading

    from tidepool.errors import ConfigError

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    threads = threading.active_count()
    with pytest.raises(ConfigError, match=r"pip install aiohttp prometheus_client, or pass dashboard=False"):
        tidepool.LocalCluster(n_workers=0, dashboard=True)
    assert threading.active_count() == threads  # no scheduler loop left running
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client" else real(name, *a))
    with tidepool.LocalCluster(n_workers=0) as cluster:  # on by default, but never what stops a cluster
        assert cluster.dashboard is None and cluster.dashboard_link == ""


def _coloured_pixels(png: Path, rect: dict[str, float]) -> int:
    """Pixels inside ``rect`` of a screenshot that are clearly coloured (not white, grey or black)."""
    image = pytest.importorskip("PIL.Image")
    with image.open(png) as im:
        box = im.convert("RGB").crop((int(rect["x"]), int(rect["y"]), int(rect["x"] + rect["width"]),
                                      int(rect["y"] + rect["height"])))  # fmt: skip
        pixels = box.get_flattened_data() if hasattr(box, "get_flattened_data") else box.getdata()
        return sum(1 for r, g, b in pixels if max(r, g, b) - min(r, g, b) > 60)


def test_the_post_mortem_page_renders_a_finished_run_from_its_journal(tmp_path: Path) -> None:
    import subprocess
    import sys

    from selenium.webdriver.common.by import By

    recs: list[dict[str, Any]] = [{"t": 0.0, "kind": "journal-start"},
                                  {"t": 0.1, "kind": "launch", "request": "a1", "node_type": "cpu", "nodes": 3,
                                   "reason": "40 tasks waiting"}]  # fmt: skip
    for w in range(3):
        recs.append({"t": 1.0 + w * 0.2, "kind": "worker-join", "worker": f"w{w}", "node_type": "cpu",
                     "resources": {"cpu": 1}})  # fmt: skip
    recs.append({"t": 1.4, "kind": "launch-arrived", "request": "a1", "node_type": "cpu", "seconds": 1.3})
    for i in range(60):
        start = 1.5 + (i // 3) * 0.5
        recs.append({"t": start + 0.45, "kind": "task", "key": f"square-{i:08x}", "worker": f"w{i % 3}",
                     "start": start, "duration": 0.45, "ok": True})  # fmt: skip
    for w in range(3):
        recs.append({"t": 13.0 + w, "kind": "retire", "worker": f"w{w}", "node_type": "cpu", "reason": "idle 2s"})
        recs.append({"t": 13.5 + w, "kind": "worker-leave", "worker": f"w{w}", "reason": "retired", "graceful": True})
    journal = tmp_path / "run.jsonl"
    journal.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "tidepool.cli", "dashboard", str(journal)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    browser = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the CLI prints the link once it serves
        assert " at http://127.0.0.1:" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        link = line.split(" at ", 1)[1].split()[0]
        browser = _browser(tmp_path)
        browser.get(link)

        def text(elem_id: str) -> str:
            return str(browser.find_element(By.ID, elem_id).text)

        # no cluster and no stream: everything comes from the first response
        wait_until(lambda: text("tasks-done") == "60", 10, "the page to show the finished run")
        assert text("status") == "post-mortem" and "square" in text("groups")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#decisions li")) == 5  # launch, arrived, 3 retires
        assert text("decisions").startswith("#71 t=15.0s retire")  # decision numbers shown whole
        slider = browser.find_element(By.ID, "slider")
        browser.execute_script("arguments[0].value = 250; arguments[0].dispatchEvent(new Event('input'))", slider)
        wait_until(lambda: text("workers-count") == "3", 10, "the slider to show the run at its busiest")
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#stream rect"), 10, "the task stream")
        shot = ARTIFACTS / "post-mortem.png"
        browser.save_screenshot(str(shot))
        for chart in ("chart-workers", "stream"):
            rect = browser.find_element(By.ID, chart).rect
            assert _coloured_pixels(shot, rect) > 200, f"{chart} looks empty in {shot}"
    finally:
        if browser is not None:
            browser.quit()
        proc.terminate()
        proc.wait(timeout=10)


def test_tidepool_scheduler_serves_the_dashboard_by_default(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "tidepool.cli", "scheduler", "--port", "0", "--token-file",
                             str(tmp_path / "token")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[0].startswith("tidepool scheduler at tcp://"), lines  # scripts read the first line
        assert lines[2].startswith("tidepool dashboard at http://127.0.0.1:"), lines
        link = lines[2].split(" at ", 1)[1].strip()
        assert b"tidepool_workers" in fetch(link + "metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_dashboard_port_out_of_range_is_a_config_error() -> None:
    """Found by a bug hunt: ``tidepool scheduler --dashboard 127.0.0.1:99999`` ended in an
    OverflowError traceback from bind()."""
    from tidepool.dashboard.server import parse_address
    from tidepool.errors import ConfigError

    with pytest.raises(ConfigError, match="0-65535"):
        parse_address("127.0.0.1:99999")
    assert parse_address("127.0.0.1:8787") == ("127.0.0.1", 8787)
