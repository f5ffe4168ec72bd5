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


def _browser() -> Any:
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
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_the_page_follows_an_elastic_run_in_a_real_browser() -> None:
    from selenium.webdriver.common.by import By

    from tidepool.scaling.policies import Adaptive, IdleRetire

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser = _browser()
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
            browser.save_screenshot(str(ARTIFACTS / "growing.png"))
            assert client.gather(futs) == list(range(30))
            del futs  # nothing held any more: every worker may go
            wait_until(lambda: text("workers-count") == "0", 40, "the page to show the pool shrinking to zero")
            assert "retire" in text("decisions")
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
    with pytest.raises(ConfigError, match=r"pip install 'tidepool\[dashboard\]'"):
        tidepool.LocalCluster(n_workers=0, dashboard=True)
    assert threading.active_count() == threads  # no scheduler loop left running
