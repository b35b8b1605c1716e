"""Killing a live worker mid-load: no request that had not started on it is lost."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from router_harness import SYSTEM_LAWYER, SYSTEM_PIRATE, completion, samples, start_router, start_worker, wait_for
from router_harness import worker_of as answered_by


def test_killing_a_worker_mid_load_loses_no_request_that_had_not_started(tiny_llama: Path) -> None:
    # Slow steps keep requests running while the worker goes; a long health interval
    # leaves the discovery to the requests themselves (refused connections).
    survivor, victim = start_worker(tiny_llama, step_delay=0.01), start_worker(tiny_llama, step_delay=0.01)
    router = start_router([survivor.base_url, victim.base_url], health_interval=60.0)
    try:
        with httpx.Client(base_url=router.base_url, timeout=60) as http, ThreadPoolExecutor(12) as pool:
            # Each system prompt's home worker is fixed by the first request of each.
            homes = {system: answered_by(completion(http, f"{system}Which ship?"))
                     for system in (SYSTEM_PIRATE, SYSTEM_LAWYER)}
            assert set(homes.values()) == {survivor.base_url, victim.base_url}

            def ask(i: int) -> httpx.Response:
                system = (SYSTEM_PIRATE, SYSTEM_LAWYER)[i % 2]
                return completion(http, f"{system}Question {i}?", max_tokens=24, ignore_eos=True)

            during = [pool.submit(ask, i) for i in range(12)]
            victim.wait_until(lambda s: s.num_running > 0, timeout=30)
            victim.stop()  # closes its port; what it was running finishes or is aborted
            after = [pool.submit(ask, i) for i in range(12, 24)]
            during_results = [f.result(timeout=60) for f in during]
            after_results = [f.result(timeout=60) for f in after]

        # Before the kill: whatever went to the survivor succeeded; only requests that
        # had reached the victim may have failed, and they say so (no hang, no loss).
        for response in during_results:
            if response.status_code != 200:
                assert answered_by(response) == victim.base_url, response.text
        assert any(r.status_code == 200 and answered_by(r) == survivor.base_url for r in during_results)
        # After the kill: half of these were the victim's by prefix; every one succeeded
        # on the survivor, retried there when the victim refused the connection.
        assert [r.status_code for r in after_results] == [200] * 12, [r.text for r in after_results]
        assert {answered_by(r) for r in after_results} == {survivor.base_url}
        metrics = samples(httpx.get(f"{router.base_url}/metrics").text)
        victim_up = ("kvloom_router_worker_up", (("worker", victim.base_url),))
        assert metrics[victim_up] == 0
        retried = metrics.get(("kvloom_router_retries_total", (("reason", "connect"), ("worker", victim.base_url))), 0)
        assert retried >= 1
        wait_for(lambda: survivor.snapshot().num_active_requests == 0, what="survivor idle")
        survivor.assert_idle_and_clean()
    finally:
        router.stop()
        survivor.stop()
        if victim.thread.is_alive():
            victim.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_aborts_its_request_on_the_worker(tiny_llama: Path, stream: bool) -> None:
    # Long enough that it could only finish as "abort" because the client left.
    worker = start_worker(tiny_llama, step_delay=0.05)
    router = start_router([worker.base_url])
    aborted = ("kvloom:request_success_total", (("finished_reason", "abort"),))
    try:
        body = {"prompt": f"{SYSTEM_PIRATE}Sing.", "max_tokens": 150, "ignore_eos": True, "stream": stream}
        with httpx.Client(base_url=router.base_url, timeout=60) as http:
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    next(response.iter_lines())  # the first event, then leave
            else:
                port = int(router.base_url.rsplit(":", 1)[1])
                with socket.create_connection(("127.0.0.1", port)) as raw:
                    payload = json.dumps(body).encode()
                    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
                    worker.wait_until(lambda s: s.num_running > 0, timeout=30)
                # closed while the router waits for the whole response

        def worker_aborted() -> bool:
            return samples(httpx.get(f"{worker.base_url}/metrics").text).get(aborted, 0) == 1
        wait_for(worker_aborted, timeout=30, what="the worker aborting the request")
        wait_for(lambda: samples(httpx.get(f"{router.base_url}/metrics").text)[
            ("kvloom_router_requests_in_flight", (("worker", worker.base_url),))] == 0, what="released")
        worker.assert_idle_and_clean()
    finally:
        router.stop()
        worker.stop()
