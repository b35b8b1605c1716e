"""Stops are decided in one place (engine/stop.py, called by Scheduler.update) and the
scheduler is the one writer of request state."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fake_runner import make_scheduler

from kvloom.batch import RunnerOutput
from kvloom.engine.stop import Stop, StopChecker
from kvloom.request import Request, RequestStatus
from kvloom.sampling_params import SamplingParams
from kvloom.structured.constraint import StructuredOutput

EOS = 2


class ScriptedText:
    """Stands in for the detokenizer: the stop string "completes" at given tokens."""

    def __init__(self, stops_at: dict[int, str]) -> None:
        self.stops_at = stops_at
        self.seen: list[int] = []

    def add_token(self, request: Request, token_id: int) -> str | None:
        self.seen.append(token_id)
        return self.stops_at.get(token_id)


def request_with(output: list[int], **params) -> Request:
    request = Request("r", [10, 11, 12], SamplingParams(**params), eos_token_ids=(EOS,))
    for token_id in output:
        request.append_output_token(token_id)
    return request


@pytest.mark.parametrize(("params", "output", "expected"), [
    ({"max_tokens": 8}, [5], None),
    ({"max_tokens": 8}, [5, EOS], Stop(RequestStatus.FINISHED_STOPPED)),
    ({"max_tokens": 8, "ignore_eos": True}, [5, EOS], None),
    ({"max_tokens": 8, "min_tokens": 3}, [5, EOS], None),  # EOS before min_tokens is ignored
    ({"max_tokens": 8, "stop_token_ids": [7]}, [5, 7], Stop(RequestStatus.FINISHED_STOPPED, 7)),
    ({"max_tokens": 2}, [5, 6], Stop(RequestStatus.FINISHED_LENGTH)),
    ({"max_tokens": 8, "stop": ["xy"]}, [5, 9], Stop(RequestStatus.FINISHED_STOPPED, "xy")),
    # A stop string completed by the last allowed token is a stop, not a length (as vLLM).
    ({"max_tokens": 2, "stop": ["xy"]}, [5, 9], Stop(RequestStatus.FINISHED_STOPPED, "xy")),
    # A grammar's EOS ends the request whatever ignore_eos and min_tokens say.
    ({"max_tokens": 8, "ignore_eos": True, "min_tokens": 5, "structured": StructuredOutput(regex="a+")},
     [5, EOS], Stop(RequestStatus.FINISHED_STOPPED)),
])
def test_stop_conditions(params, output, expected) -> None:
    checker = StopChecker(ScriptedText({9: "xy"}))
    assert checker.check(request_with(output, **params), output[-1]) == expected


def test_forced_tokens_after_a_stop_string_are_never_appended() -> None:
    """A sampled token, then three a grammar forces; the second completes a stop string:
    exactly two are appended, and the update says so."""
    text = ScriptedText({41: "stop!"})
    scheduler = make_scheduler(stops=StopChecker(text))
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, stop=["stop!"]))
    scheduler.add_request(request)
    output = scheduler.schedule()
    updates = scheduler.update(output, RunnerOutput([40], [None], forced=[[41, 42, 43]]))
    assert [(u.request, u.index, u.num_new_tokens) for u in updates] == [(request, 0, 2)]
    assert request.output_token_ids == [40, 41]
    assert request.all_token_ids == [1, 2, 3, 4, 5, 40, 41]
    assert text.seen == [40, 41]
    assert (request.status, request.stop_reason) == (RequestStatus.FINISHED_STOPPED, "stop!")
    assert scheduler.kv.num_available_blocks == scheduler.kv.num_blocks  # its blocks are back
    scheduler.check_integrity()


def test_a_failing_stop_check_fails_only_its_request() -> None:
    class Broken(ScriptedText):
        def add_token(self, request: Request, token_id: int) -> str | None:
            if request.request_id == "bad":
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return None

    scheduler = make_scheduler(stops=StopChecker(Broken({})))
    good = Request("good", [1, 2, 3], SamplingParams(max_tokens=4))
    bad = Request("bad", [4, 5, 6], SamplingParams(max_tokens=4))
    scheduler.add_request(good)
    scheduler.add_request(bad)
    output = scheduler.schedule()
    updates = scheduler.update(output, RunnerOutput([7, 8], [None, None]))
    assert [(u.request.request_id, u.num_new_tokens) for u in updates] == [("good", 1), ("bad", 1)]
    assert bad.status is RequestStatus.FINISHED_ERROR and "UnicodeDecodeError" in bad.error.message
    assert good.status is RequestStatus.RUNNING and good.output_token_ids == [7]
    scheduler.check_integrity()


def test_a_runner_failure_finishes_the_request_with_its_error() -> None:
    from kvloom.request import RequestError

    scheduler = make_scheduler()
    request = Request("g", [1, 2, 3], SamplingParams(max_tokens=4))
    scheduler.add_request(request)
    output = scheduler.schedule()
    error = RequestError("grammar too complex", caused_by_request=True)
    updates = scheduler.update(output, RunnerOutput([7], [None], failed={"g": error}))
    assert [(u.request, u.num_new_tokens) for u in updates] == [(request, 0)]
    assert request.output_token_ids == [] and request.error is error
    assert scheduler.kv.num_available_blocks == scheduler.kv.num_blocks


# ---- who writes request state ---------------------------------------------------------
KVLOOM = Path(__file__).resolve().parents[2] / "kvloom"
# Attributes only a Request has, and the files allowed to assign them.
OWNERS = {"block_ids": {"cache/kv_manager.py"}, "state_slot": {"cache/state_pool.py"}}
SCHEDULER_OWNED = ("num_computed_tokens", "output_token_ids", "all_token_ids", "stop_reason",
                   "num_cached_tokens", "cache_miss_reason", "num_preemptions", "status", "error")


def request_state_writers() -> dict[str, set[str]]:
    """attribute -> files that assign it (or delete from it) on something named
    ``request``/``victim``/``r``, or call ``append_output_token``."""
    writers: dict[str, set[str]] = {}
    for path in KVLOOM.rglob("*.py"):
        relative = path.relative_to(KVLOOM).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "append_output_token"):
                writers.setdefault("output_token_ids", set()).add(relative)
            for target in targets:
                while isinstance(target, ast.Subscript):
                    target = target.value
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in ("request", "victim", "r")):
                    writers.setdefault(target.attr, set()).add(relative)
    return writers


def test_the_scheduler_is_the_one_writer_of_request_state() -> None:
    writers = request_state_writers()
    assert writers["num_computed_tokens"] == {"engine/scheduler.py"}
    for attribute in SCHEDULER_OWNED:
        assert writers.get(attribute, set()) <= {"engine/scheduler.py"}, attribute
    for attribute, owners in OWNERS.items():
        assert writers[attribute] == owners, attribute
