"""The live dashboard (server/dashboard.py, live_stats.py, static/): its data against what
the requests did (counts from the API's own usage, a preemption forced by a small
pool, the wait reasons the scheduler gave), its access rules, its event stream, and the
page itself in a real browser (Debian's Chromium through Selenium): the charts and the
timeline show the requests sent, the page updates, a click shows a request's story."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from server_harness import SERVED_NAME, start_live_server

from kvloom.config import EngineConfig
from kvloom.server.dashboard import TRACE_CAPACITY, with_trace
from kvloom.server.live_stats import RequestRow, percentiles
from kvloom.server.settings import ServerSettings

NUM_REQUESTS = 6
MAX_TOKENS = 30


def prompt(i: int) -> list[int]:
    return [5 + i] * (20 + 3 * i)


def send_all(base_url: str, count: int = NUM_REQUESTS, api_key: str | None = None) -> list[dict]:
    """``count`` completions at once: a 12-block pool of 16 tokens holds about three."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def one(i: int) -> dict:
        with httpx.Client(base_url=base_url, timeout=120, headers=headers) as client:
            response = client.post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt(i),
                                                             "max_tokens": MAX_TOKENS, "ignore_eos": True})
            response.raise_for_status()
            return response.json()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


@pytest.fixture(scope="module")
def loaded_server(tiny_llama: Path):
    """A server whose steps take 20 ms at least (so a run spans several 0.5 s samples)
    and whose pool is too small for all six requests: some are preempted, some wait."""
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME, api_key="secret"),
                             step_delay=0.02, num_blocks=12, trace=True)
    responses = send_all(live.base_url, api_key="secret")
    yield live, responses
    live.stop()


def dashboard_data(base_url: str) -> dict:
    return httpx.get(f"{base_url}/dashboard/data", timeout=30).json()


def test_rows_and_samples_tell_what_the_requests_did(loaded_server) -> None:
    live, responses = loaded_server
    live.assert_idle_and_clean()
    data = dashboard_data(live.base_url)
    rows = {row["id"]: row for row in data["rows"]}
    assert data["model"] and data["num_blocks"] == 12
    for response in responses:
        row = rows[f"{response['id']}-0"]  # the engine's id of the completion's only choice
        assert row["status"] == "length"
        assert row["output_tokens"] == response["usage"]["completion_tokens"] == MAX_TOKENS
        assert row["prompt_tokens"] == response["usage"]["prompt_tokens"]
        kinds = [segment[2] for segment in row["segments"]]
        assert kinds[-1] == "finished" and "prefill" in kinds and "decode" in kinds
        # Every token the request computed is in its segments: the prompt (again after each
        # preemption) and MAX_TOKENS - 1 decodes (the last sampled token is never computed).
        computed = sum(segment[3] for segment in row["segments"] if segment[2] in ("prefill", "decode"))
        assert computed >= row["prompt_tokens"] + MAX_TOKENS - 1
    segments = [segment for row in rows.values() for segment in row["segments"]]
    assert any(kind == "preempted" and reason.startswith("no free blocks for") for *_, kind, reason in segments)
    assert any(kind == "wait" and reason in ("no free blocks", "pool full (preempted this step)")
               for *_, kind, reason in segments)
    samples = data["samples"]
    assert len(samples) >= 2
    assert sum(s["output_tps"] * 0.5 for s in samples) > 0
    assert max(s["preemptions_total"] for s in samples) > 0
    assert all(0 <= s["kv_used"] and 0 <= s["kv_cached"] and s["kv_used"] + s["kv_cached"] <= 12 for s in samples)
    assert max(s["kv_used"] for s in samples) >= 9  # six requests in a pool of twelve fill it
    assert any(s["ttft"][0] is not None and s["itl"][0] is not None for s in samples)
    # The engine is idle now (assert_idle_and_clean): the newest sample says so, rather
    # than the last busy one's requests and blocks.
    assert (samples[-1]["running"], samples[-1]["waiting"], samples[-1]["kv_used"]) == (0, 0, 0)


def test_a_request_row_and_the_missing_one(loaded_server) -> None:
    live, responses = loaded_server
    request_id = f"{responses[0]['id']}-0"
    row = httpx.get(f"{live.base_url}/dashboard/requests/{request_id}").json()
    assert row["id"] == request_id and row["output_tokens"] == MAX_TOKENS
    missing = httpx.get(f"{live.base_url}/dashboard/requests/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_the_dashboard_follows_the_rule_of_metrics(loaded_server) -> None:
    live, _ = loaded_server
    assert httpx.get(f"{live.base_url}/v1/models").status_code == 401  # the key is required there
    for path in ("/metrics", "/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js",
                 "/dashboard/static/vendor/uplot-1.6.32/uPlot.iife.min.js"):
        assert httpx.get(f"{live.base_url}{path}").status_code == 200, path


def test_the_event_stream_sends_what_changed(loaded_server) -> None:
    live, _ = loaded_server
    messages = []
    with httpx.stream("GET", f"{live.base_url}/dashboard/events?since=0&interval=0.1", timeout=30) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                messages.append(json.loads(line[len("data: "):]))
                if len(messages) == 2:
                    break
    first, second = messages
    assert first["rows"] and first["samples"]  # since 0: everything kept
    assert second["version"] == first["version"] and not second["rows"] and not second["samples"]  # idle


def test_off_with_the_flag(tiny_llama: Path) -> None:
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME, enable_dashboard=False))
    try:
        assert httpx.get(f"{live.base_url}/dashboard").status_code == 404
        assert httpx.get(f"{live.base_url}/dashboard/data").status_code == 404
    finally:
        live.stop()


def test_serve_turns_a_short_trace_on_and_keeps_one_asked_for() -> None:
    config = with_trace(EngineConfig())
    assert config.scheduler.trace and config.scheduler.trace_capacity == TRACE_CAPACITY
    asked = EngineConfig.from_kwargs("m", trace=True, trace_capacity=50)
    assert with_trace(asked) is asked


def test_segments_merge_runs_and_percentiles_are_nearest_rank() -> None:
    row = RequestRow("r")
    for step, kind, detail in [(1, "wait", "token budget"), (2, "wait", "token budget"), (3, "wait", "no free blocks"),
                               (4, "prefill", 16), (5, "prefill", 8), (6, "decode", 1), (7, "decode", 1),
                               (9, "decode", 1), (9, "preempted", "no free blocks for x")]:
        row.add(step, kind, detail)
    assert row.segments == [[1, 2, "wait", "token budget"], [3, 3, "wait", "no free blocks"],
                            [4, 5, "prefill", 24], [6, 7, "decode", 2], [9, 9, "decode", 1],
                            [9, 9, "preempted", "no free blocks for x"]]
    assert percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == [3.0, 5.0, 5.0]
    assert percentiles(list(range(1, 101))) == [50, 90, 99]
    assert percentiles([]) == [None, None, None]


# ---- the page in a browser -------------------------------------------------------------
def browser():
    """Headless Chromium through Selenium, or a skip that says what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no browser here: Debian's chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver; make test installs them where apt works)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    from selenium.webdriver.chrome.service import Service
    return webdriver.Chrome(service=Service(driver_path), options=options)


def wait_for(driver, script: str, deadline_s: float = 30.0):
    """Poll the page's state until ``script`` returns something truthy (the browser
    updates on its own schedule; this is a deadline, not a synchronisation by sleep)."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = driver.execute_script(script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never satisfied: {script}")
        time.sleep(0.1)


def test_the_page_shows_the_requests_and_updates_live(tiny_llama: Path, tmp_path: Path) -> None:
    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME),
                             step_delay=0.02, num_blocks=12, trace=True)
    driver = browser()
    try:
        driver.get(f"{live.base_url}/dashboard")
        wait_for(driver, "return window.kvloom && document.getElementById('connection').textContent === 'live'")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(send_all, live.base_url)
            # Updates arrive while the requests run: the page redraws as they come.
            during = wait_for(driver, "const s = window.kvloom.state; return s.rows.size > 0 && s.updates")
            responses = load.result(timeout=120)
        ids = {f"{response['id']}-0" for response in responses}
        wait_for(driver, f"return [...window.kvloom.state.rows.values()]"
                         f".filter(r => r.status === 'length').length === {NUM_REQUESTS}")
        assert driver.execute_script("return window.kvloom.state.updates") > during
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By

        # The page redraws the timeline on every update (samples keep coming): read it in
        # one script, which runs between two redraws, rather than element by element.
        def attributes(selector: str, name: str) -> list[str]:
            return driver.execute_script(
                "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]))",
                selector, name)

        assert set(attributes("#timeline .tl-row", "data-request-id")) == ids
        assert attributes("#timeline .seg.preempted", "class")
        waits = attributes("#timeline .seg.wait", "title")
        assert any("waited: no free blocks" in title or "waited: pool full" in title for title in waits)
        assert int(driver.find_element(By.ID, "stat-preemptions").text) > 0
        # The charts hold the samples the server sent: uPlot's own data arrays.
        assert driver.execute_script("return window.kvloom.state.samples.length") >= 2
        assert driver.find_elements(By.CSS_SELECTOR, "#chart-throughput canvas")
        # A click tells one request's story: where it waited and why.
        for _attempt in range(5):  # a redraw between finding the row and clicking it: find it again
            try:
                preempted = driver.find_element(By.CSS_SELECTOR, "#timeline .tl-row:has(.seg.preempted)")
                clicked = preempted.get_attribute("data-request-id")
                preempted.click()  # the timeline redraws with the row selected
                break
            except StaleElementReferenceException:
                continue
        else:
            pytest.fail("the timeline kept redrawing under every click")
        wait_for(driver, "return !document.getElementById('detail').hidden && "
                         "document.querySelectorAll('#detail .event').length")
        detail = driver.find_element(By.ID, "detail")
        assert detail.get_attribute("data-request-id") == clicked
        assert "preempted: no free blocks for" in detail.text and "finished: length" in detail.text
        shot = Path(os.environ.get("KVLOOM_SCREENSHOT_DIR", tmp_path)) / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    finally:
        driver.quit()
        live.stop()
