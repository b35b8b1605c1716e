"""The disaggregated router's start: the flags and their refusals, the handshake with
every instance (roles, KV layouts), and `kvloom serve --role disaggregated`'s children."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import pytest
from disagg_harness import DECODE_A, DECODE_B, LAYOUT, PREFILL_A, PREFILL_B, FakeInstances, disagg_config

from kvloom.cli import build_parser, main
from kvloom.router import launch
from kvloom.router.config import RouterConfig
from kvloom.router.launch import DISAGGREGATED_FLAGS, DISAGGREGATED_ROLES, worker_argv, worker_commands
from kvloom.router.workers import RouterStartupError, WorkerInfo, check_workers


def check(instances: FakeInstances) -> dict[str, WorkerInfo]:
    return asyncio.run(check_workers(disagg_config(instances, startup_timeout=5.0),
                                     httpx.MockTransport(instances)))


# ---- flags -------------------------------------------------------------------------------
def test_prefill_and_decode_flags_make_two_pools() -> None:
    from kvloom.router.cli import router_config

    args = build_parser().parse_args(["router", "--prefill", "h:1", "--prefill", "http://h:2/", "--decode", "h:3"])
    config = router_config(args, args.worker, args.prefill, args.decode)
    assert config.disaggregated
    assert config.prefill == ("http://h:1", "http://h:2") and config.decode == ("http://h:3",)
    assert config.workers == ("http://h:1", "http://h:2", "http://h:3")  # health, /metrics: all of them
    assert not RouterConfig(("http://h:1",)).disaggregated


@pytest.mark.parametrize(("argv", "message"), [
    (["--worker", "http://w:1", "--prefill", "http://p:1", "--decode", "http://d:1"],
     "--worker cannot be combined with --prefill/--decode"),
    (["--prefill", "http://p:1"], "--prefill needs at least one --decode URL"),
    (["--decode", "http://d:1"], "--decode needs at least one --prefill URL"),
    ([], "give at least one worker URL"),
    (["--prefill", "http://h:1", "--decode", "http://h:1"], "http://h:1 is given more than once"),
])
def test_bad_pool_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", *argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert message in err and "checking" not in err  # refused before anything is contacted


# ---- the handshake -----------------------------------------------------------------------
def test_agreeing_instances_pass_with_their_roles() -> None:
    instances = FakeInstances({PREFILL_A: "prefill", PREFILL_B: "prefill", DECODE_A: "decode",
                               DECODE_B: "decode"})
    infos = check(instances)
    assert {url: info.role for url, info in infos.items()} == {
        PREFILL_A: "prefill", PREFILL_B: "prefill", DECODE_A: "decode", DECODE_B: "decode"}


@pytest.mark.parametrize(("url", "role", "pool"), [(PREFILL_A, "decode", "prefill"), (DECODE_A, "both", "decode"),
                                                    (DECODE_A, "prefill", "decode")])
def test_an_instance_in_the_wrong_role_is_refused(url: str, role: str, pool: str) -> None:
    instances = FakeInstances({PREFILL_A: "prefill", DECODE_A: "decode"})
    instances.reported_roles[url] = role
    with pytest.raises(RouterStartupError, match=f"{pool} {url} reports role '{role}'.*--role {pool}"):
        check(instances)


@pytest.mark.parametrize(("field", "value", "shown"), [
    ("block_size", 32, "block_size 32 but prefill http://prefill-a:1 has 16"),
    ("dtype", "float16", "dtype 'float16' but prefill http://prefill-a:1 has 'bfloat16'"),
    ("cache_layout", "split", "cache_layout 'split' but prefill http://prefill-a:1 has 'paired'"),
    ("model_fingerprint", "beef", "model_fingerprint 'beef' but prefill http://prefill-a:1 has 'f00d'"),
])
def test_a_layout_mismatch_names_the_field_both_values_and_both_instances(field: str, value: Any,
                                                                         shown: str) -> None:
    instances = FakeInstances({PREFILL_A: "prefill", DECODE_A: "decode"})
    instances.layouts[DECODE_A][field] = value
    with pytest.raises(RouterStartupError) as error:
        check(instances)
    assert str(error.value) == (f"decode {DECODE_A} has {shown}: instances of a different model, dtype, "
                                "block size or cache layout cannot share KV")


def test_a_second_prefill_instance_must_match_the_first_too() -> None:
    instances = FakeInstances({PREFILL_A: "prefill", PREFILL_B: "prefill", DECODE_A: "decode"})
    instances.layouts[PREFILL_B] = {**LAYOUT, "num_layers": 24}
    with pytest.raises(RouterStartupError, match=f"prefill {PREFILL_B} has num_layers 24 but prefill "
                                                 f"{PREFILL_A} has 30"):
        check(instances)
    instances.layouts[PREFILL_B] = {**LAYOUT, "extra": 1}  # a field only one side reports differs too
    with pytest.raises(RouterStartupError, match="has extra 1 but prefill .* has None"):
        check(instances)


def test_an_instance_without_the_handshake_is_refused() -> None:
    instances = FakeInstances({PREFILL_A: "prefill", DECODE_A: "decode"})
    instances.kv_transfer[DECODE_A] = httpx.Response(404, json={"detail": "Not Found"})
    with pytest.raises(RouterStartupError, match=f"instance {DECODE_A} answered GET /kvloom/kv_transfer with 404"):
        check(instances)
    instances.kv_transfer[DECODE_A] = httpx.Response(200, json={"role": "decode"})
    with pytest.raises(RouterStartupError, match="is not a KV transfer description"):
        check(instances)


def test_the_model_check_still_comes_first() -> None:
    instances = FakeInstances({PREFILL_A: "prefill", DECODE_A: "decode"})

    async def other_model(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models" and request.url.host == "decode-a":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "other", "object": "model", "max_model_len": 256, "block_size": 16}]})
        return await instances(request)

    with pytest.raises(RouterStartupError, match=f"model: {PREFILL_A} has 'tiny', {DECODE_A} has 'other'"):
        asyncio.run(check_workers(disagg_config(instances), httpx.MockTransport(other_model)))


# ---- kvloom serve --role disaggregated ---------------------------------------------------
def test_role_disaggregated_with_data_parallel_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["serve", "MODEL", "--role", "disaggregated", "--data-parallel-size", "2"]
    monkeypatch.setattr(sys, "argv", ["kvloom", *argv])
    with pytest.raises(ValueError, match="cannot be combined with --data-parallel-size 2"):
        args = build_parser().parse_args(argv)
        args.run(args)
    assert main(argv) == 2


def test_role_disaggregated_needs_its_own_command_line() -> None:
    # Called from Python with an argv that is not sys.argv, the children's command line is unknown.
    assert main(["serve", "MODEL", "--role", "disaggregated"]) == 2


def test_the_children_get_the_engine_flags_their_role_and_a_port() -> None:
    argv = ["MODEL", "--role", "disaggregated", "--dtype", "float32", "--port", "9000", "--host=0.0.0.0",
            "--router-policy", "round_robin", "--startup-timeout", "30", "--api-key", "k", "--role=disaggregated"]
    commands = worker_commands(worker_argv(argv, DISAGGREGATED_FLAGS), [7001, 7002], 4, DISAGGREGATED_ROLES)
    engine = [sys.executable, "-m", "kvloom", "serve", "MODEL", "--dtype", "float32", "--api-key", "k",
              "--num-threads", "4"]
    assert commands == [[*engine, "--role", "prefill", "--host", "127.0.0.1", "--port", "7001"],
                        [*engine, "--role", "decode", "--host", "127.0.0.1", "--port", "7002"]]
    for command in commands:  # each parses as a serve command line in its role
        args = build_parser().parse_args(command[3:])
        assert args.role in ("prefill", "decode") and args.num_threads == 4 and args.port in (7001, 7002)


def test_the_launcher_starts_prefill_then_decode_and_routes_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    started: dict[str, Any] = {}

    def start_workers(argv: list[str], ports: list[int], num_threads: int | None,
                      extra: list[list[str]]) -> list[Any]:
        started.update(argv=argv, ports=ports, num_threads=num_threads, extra=extra)
        return []

    def run_router(config: RouterConfig, **kwargs: Any) -> int:
        started["config"] = config
        return 0

    monkeypatch.setattr(launch, "start_workers", start_workers)
    monkeypatch.setattr(launch, "wait_until_healthy", lambda processes, urls, timeout: None)
    monkeypatch.setattr(launch, "run_router", run_router)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 16)
    argv = ["MODEL", "--role", "disaggregated", "--port", "0", "--router-policy", "least_loaded"]
    args = build_parser().parse_args(["serve", *argv])
    from kvloom.router.cli import router_config

    def pools(prefill: list[str], decode: list[str]) -> RouterConfig:
        return router_config(args, (), prefill, decode)
    assert launch.run_disaggregated(args, argv, pools) == 0
    assert started["argv"] == ["MODEL"]
    assert started["extra"] == DISAGGREGATED_ROLES
    assert started["num_threads"] == 8  # half the cores each
    prefill_port, decode_port = started["ports"]
    config = started["config"]
    assert config.prefill == (f"http://127.0.0.1:{prefill_port}",)
    assert config.decode == (f"http://127.0.0.1:{decode_port}",)
    assert config.policy == "least_loaded"
    # --num-threads given: the children keep it as given.
    args = build_parser().parse_args(["serve", *argv, "--num-threads", "3"])
    assert launch.run_disaggregated(args, [*argv, "--num-threads", "3"], pools) == 0
    assert started["num_threads"] is None and started["argv"] == ["MODEL", "--num-threads", "3"]


def test_each_child_is_pinned_to_its_half_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert launch.core_shares(len(DISAGGREGATED_ROLES)) == [(0, 1, 2, 3), (4, 5, 6, 7)]

