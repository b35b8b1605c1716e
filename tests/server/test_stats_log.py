"""The periodic stats line: a pure rule over EngineStats and clock readings passed in
(no sleeps, no wall clock). Rates below are hand-computed from the token counts."""

from __future__ import annotations

import logging

import pytest

from kvloom.engine.engine import EngineStats
from kvloom.server.stats_log import StatsLogger, format_stats_line


def _stats(running: int = 0, waiting: int = 0, kv_usage: float = 0.0, prompt: int = 0,
           generated: int = 0, queried: int = 0, hit: int = 0) -> EngineStats:
    return EngineStats(step=0, num_running=running, num_waiting=waiting, kv_usage=kv_usage,
                       num_preemptions=0, num_free_blocks=0, num_blocks=10, num_cached_blocks=0,
                       num_evicted_blocks=0, prefix_cache_queried_tokens=queried,
                       prefix_cache_hit_tokens=hit, num_prompt_tokens=prompt,
                       num_generation_tokens=generated)


def test_the_line_reads_like_vllms() -> None:
    line = format_stats_line(_stats(running=3, waiting=1, kv_usage=0.125), 5.0, 1000, 250, 400, 100)
    assert line == ("Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, "
                    "Prefix cache hit rate: 25.0%")


def test_one_line_per_interval_while_busy_with_the_windows_rates() -> None:
    logger = StatsLogger(interval=5.0, now=100.0)
    logger.resume(100.0)
    assert logger.observe(101.0, _stats(running=2, prompt=300, generated=2)) is None
    assert logger.observe(104.9, _stats(running=2, prompt=300, generated=40)) is None
    line = logger.observe(105.0, _stats(running=2, kv_usage=0.5, prompt=300, generated=50,
                                        queried=300, hit=60))
    # Window 100..105: 300 prompt tokens / 5 s, 50 generated / 5 s, 60 of 300 queried hit.
    assert line is not None
    assert "Avg prompt throughput: 60.0 tokens/s" in line
    assert "Avg generation throughput: 10.0 tokens/s" in line
    assert "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 50.0%" in line
    assert "Prefix cache hit rate: 20.0%" in line
    # The next window counts only what came after 105.
    assert logger.observe(107.0, _stats(running=1, prompt=300, generated=70, queried=300, hit=60)) is None
    line = logger.observe(110.0, _stats(running=1, prompt=300, generated=100, queried=300, hit=60))
    assert line is not None
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s" in line
    assert "Prefix cache hit rate: 0.0%" in line


def test_going_idle_logs_the_last_window_then_nothing() -> None:
    logger = StatsLogger(interval=5.0, now=0.0)
    logger.resume(0.0)
    assert logger.observe(1.0, _stats(running=1, prompt=10, generated=1)) is None
    # All finished at t=2: the unfinished window is reported at once, over its 2 s.
    line = logger.observe(2.0, _stats(prompt=10, generated=4))
    assert line is not None and "Avg prompt throughput: 5.0 tokens/s" in line
    assert "Avg generation throughput: 2.0 tokens/s" in line and "Running: 0 reqs" in line
    # Idle: nothing, however long.
    assert logger.observe(3.0, _stats(prompt=10, generated=4)) is None
    assert logger.observe(1000.0, _stats(prompt=10, generated=4)) is None


def test_an_idle_gap_does_not_dilute_the_next_window() -> None:
    logger = StatsLogger(interval=5.0, now=0.0)
    logger.resume(0.0)
    logger.observe(1.0, _stats(prompt=10, generated=1))  # idle from t=1
    logger.resume(3600.0)  # work arrives an hour later
    assert logger.observe(3601.0, _stats(running=1, prompt=60, generated=2)) is None
    line = logger.observe(3605.0, _stats(running=1, prompt=60, generated=21))
    # 50 prompt and 20 generated tokens over 3600..3605, not over the idle hour.
    assert line is not None and "Avg prompt throughput: 10.0 tokens/s" in line
    assert "Avg generation throughput: 4.0 tokens/s" in line


def test_a_quiet_engine_never_logs() -> None:
    logger = StatsLogger(interval=5.0, now=0.0)
    assert all(logger.observe(t, _stats()) is None for t in (0.0, 5.0, 10.0, 100.0))


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stats log interval must be > 0 seconds, got 0"):
        StatsLogger(interval=0, now=0.0)


@pytest.mark.parametrize("interval", [5.0, None], ids=["log-stats", "disable-log-stats"])
def test_the_engine_thread_logs_a_line_only_when_asked(tiny_llama, caplog, interval) -> None:
    """A served request ends in one stats line (its window, reported when the engine
    goes idle, before the response is delivered); with --disable-log-stats, none."""
    import httpx
    from server_harness import SERVED_NAME, start_live_server

    from kvloom.server.settings import ServerSettings

    live = start_live_server(tiny_llama, ServerSettings(served_model_name=SERVED_NAME),
                             stats_log_interval=interval)
    try:
        with caplog.at_level(logging.INFO, logger="kvloom.server.async_engine"):
            response = httpx.post(f"{live.base_url}/v1/completions", timeout=60, json={
                "model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
            assert response.status_code == 200
            lines = [r.getMessage() for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    finally:
        live.stop()
    if interval is None:
        assert lines == []
    else:
        assert len(lines) == 1 and "Running: 0 reqs, Waiting: 0 reqs" in lines[0], lines


def test_engine_stats_count_prompt_and_generated_tokens(tiny_llama) -> None:
    from kvloom.config import EngineConfig
    from kvloom.engine.engine import LLMEngine
    from kvloom.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(str(tiny_llama), dtype="float32", num_blocks=32))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    # 5 prompt tokens computed once; 4 tokens generated (the first by the prefill step).
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (5, 4)
