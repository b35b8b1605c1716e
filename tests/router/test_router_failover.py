"""Killing a live worker mid-load: no request that had not started on it is lost."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
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
