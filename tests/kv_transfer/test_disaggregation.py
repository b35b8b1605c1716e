"""Prefill/decode disaggregation, engine to engine: a prompt computed and staged by a
--role prefill engine, pulled by a --role decode engine, decodes exactly what one
--role both engine decodes (greedy), through both transports and both dtypes; with
prefix hits on either side, preemption on the decode side, a full decode pool, a
staging area that makes prefills wait, a peer gone mid-way and mismatched layouts.
Every engine's books are checked after every step (check_integrity)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_models import write_tiny_hf_model

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import RequestOutput
from kvloom.kv_spec import KVExport, KVImport, KVTransferSpec, StagedKV
from kvloom.kv_transfer.connector import DecodeTransfer
from kvloom.kv_transfer.staging import remove_orphans
from kvloom.kv_transfer.transport import SharedMemoryTransport, TorchTransport, TransferFailed
from kvloom.request import RequestStatus
from kvloom.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
Job = tuple[str, list[int], SamplingParams, KVTransferSpec | None]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64: bf16 caches use the CPU backend's paired layout (and the native stack).
    return write_tiny_hf_model(tmp_path_factory.mktemp("pd-model"), arch="llama", hidden_size=128,
                               intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                               num_hidden_layers=2)


def engine(model_dir: Path, role: str, tmp_path: Path, dtype: str = "bfloat16", **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 64)
    return LLMEngine(EngineConfig.from_kwargs(str(model_dir), dtype=dtype, role=role, kv_shm_dir=str(tmp_path),
                                              **kwargs))


def run(engine_: LLMEngine, jobs: list[Job], loras: dict[str, Any] | None = None) -> dict[str, RequestOutput]:
    """Every job to its end (``loras``: a request id's LoRA adapter, if any)."""
    finals: dict[str, RequestOutput] = {}
    for request_id, prompt, params, spec in jobs:
        engine_.add_request(prompt, params, request_id=request_id, kv_transfer=spec,
                            lora_request=(loras or {}).get(request_id))
    while engine_.has_unfinished_requests():
        for output in engine_.step():
            if output.finished:
                finals[output.request_id] = output
        engine_.check_integrity()
    return finals


def prefill(engine_: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, StagedKV]:
    finals = run(engine_, [(rid, p, SamplingParams(max_tokens=1), KVExport()) for rid, p in prompts.items()])
    return {rid: StagedKV.from_dict(out.kv_transfer_params) for rid, out in finals.items()}


def tokens(finals: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


def prompts_of(lengths: list[int], seed: int = 0) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(10, 500, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pair_decodes_what_one_instance_decodes(model_dir: Path, tmp_path: Path, transport: str,
                                                 dtype: str) -> None:
    prompts = prompts_of([1, 5, 16, 17, 33, 90])
    single = run(engine(model_dir, "both", tmp_path, dtype),
                 [(rid, p, GREEDY, None) for rid, p in prompts.items()])
    producer = engine(model_dir, "prefill", tmp_path, dtype)
    consumer = engine(model_dir, "decode", tmp_path, dtype, kv_transport=transport)
    try:
        staged = prefill(producer, prompts)
        pair = run(consumer, [(rid, p, GREEDY, KVImport(staged[rid])) for rid, p in prompts.items()])
        assert tokens(pair) == tokens(single)
        stats = consumer.stats()
        # Every prompt but the 1-token one pulled its KV; only the last tokens were computed.
        assert (stats.kv_imports, stats.kv_import_failures) == (5, 0)
        assert stats.num_prompt_tokens == len(prompts)
        layout = consumer.kv_layout
        assert stats.kv_import_bytes == sum(-(-(len(p) - 1) // 16) for p in prompts.values()) * layout.bytes_per_block
        consumer.shutdown()  # its transfer thread done: every last pull has told the prefill side
        producer.kv_transfer.poll()
        # Each prompt's last (here: only) puller dropped it, the 1-token one without pulling.
        assert producer.stats().kv_staged_pulled == len(prompts)
        assert producer.kv_transfer.staging.used_bytes == 0
    finally:
        producer.shutdown()
        consumer.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_prefix_hits_on_both_sides(model_dir: Path, tmp_path: Path) -> None:
    shared = prompts_of([48], seed=1)["r0"]
    prompts = {"a": shared + [7, 8, 9], "b": shared + [11, 12, 13, 14, 15]}
    single = run(engine(model_dir, "both", tmp_path), [(rid, p, GREEDY, None) for rid, p in prompts.items()])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path)
    try:
        first = prefill(producer, {"a": prompts["a"]})
        second = run(producer, [("b", prompts["b"], SamplingParams(max_tokens=1), KVExport())])
        assert second["b"].num_cached_tokens == 48  # the prefill side's cache served b's prefix
        staged_b = StagedKV.from_dict(second["b"].kv_transfer_params)
        pair = run(consumer, [("a", prompts["a"], GREEDY, KVImport(first["a"]))])
        pulled_a = consumer.stats().kv_import_bytes
        pair |= run(consumer, [("b", prompts["b"], GREEDY, KVImport(staged_b))])
        assert tokens(pair) == tokens(single)
        # b found the shared 3 blocks in the decode side's cache (a's imported blocks),
        # so it pulled only its own last block.
        assert consumer.stats().kv_import_bytes - pulled_a == consumer.kv_layout.bytes_per_block
        assert pair["b"].num_cached_tokens == 48
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_samples_share_one_staged_prompt(model_dir: Path, tmp_path: Path) -> None:
    prompt = prompts_of([40], seed=2)["r0"]
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    single = run(engine(model_dir, "both", tmp_path), [(f"s{i}", prompt, p, None) for i, p in enumerate(seeded)])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path)
    try:
        staged = prefill(producer, {"p": prompt})["p"]
        pair = run(consumer, [(f"s{i}", prompt, p, KVImport(staged, pulls=2)) for i, p in enumerate(seeded)])
        assert tokens(pair) == tokens(single)
        consumer.shutdown()
        producer.kv_transfer.poll()
        assert producer.kv_transfer.staging.num_staged == 0  # the second, last pull dropped it
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_preemption_on_the_decode_side(model_dir: Path, tmp_path: Path) -> None:
    prompts = prompts_of([30, 31, 29, 33, 28], seed=3)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    single = run(engine(model_dir, "both", tmp_path), [(rid, p, long, None) for rid, p in prompts.items()])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path, num_blocks=16)  # 5 x 5 blocks at the end: too few
    try:
        staged = prefill(producer, prompts)
        pair = run(consumer, [(rid, p, long, KVImport(staged[rid])) for rid, p in prompts.items()])
        assert consumer.stats().num_preemptions > 0
        assert tokens(pair) == tokens(single)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_full_decode_pool_makes_requests_wait_then_serves_them(model_dir: Path, tmp_path: Path) -> None:
    prompts = prompts_of([60, 60, 60], seed=4)
    single = run(engine(model_dir, "both", tmp_path), [(rid, p, GREEDY, None) for rid, p in prompts.items()])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path, num_blocks=6)  # one request's 5 blocks at a time
    try:
        staged = prefill(producer, prompts)
        for rid, prompt in prompts.items():
            consumer.add_request(prompt, GREEDY, request_id=rid, kv_transfer=KVImport(staged[rid]))
        consumer.step()
        assert len(consumer.scheduler.receiving) + len(consumer.scheduler.running) == 1
        assert len(consumer.scheduler.waiting) == 2  # waiting for blocks, their KV still staged
        finals: dict[str, RequestOutput] = {}
        while consumer.has_unfinished_requests():
            finals |= {o.request_id: o for o in consumer.step() if o.finished}
            consumer.check_integrity()
        assert tokens(finals) == tokens(single)
        assert consumer.stats().kv_imports == 3  # each pulled once it had blocks: nothing recomputed
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_staging_budget_makes_prefills_wait(model_dir: Path, tmp_path: Path) -> None:
    prompts = prompts_of([64, 64], seed=5)
    producer = engine(model_dir, "prefill", tmp_path, trace=True)
    one_prompt = producer.kv_transfer.staging.nbytes_for(64)
    producer.kv_transfer.staging.budget_bytes = one_prompt  # room for one staged prompt
    consumer = engine(model_dir, "decode", tmp_path)
    try:
        for rid, prompt in prompts.items():
            producer.add_request(prompt, SamplingParams(max_tokens=1), request_id=rid, kv_transfer=KVExport())
        finals: dict[str, RequestOutput] = {}
        for _ in range(4):
            finals |= {o.request_id: o for o in producer.step() if o.finished}
            producer.check_integrity()
        assert list(finals) == ["r0"]
        assert [r.request_id for r in producer.scheduler.waiting] == ["r1"]  # waits, uncomputed
        assert producer.scheduler.trace.records[-1].waiting == [("r1", "KV staging full")]
        staged = StagedKV.from_dict(finals["r0"].kv_transfer_params)
        run(consumer, [("r0", prompts["r0"], GREEDY, KVImport(staged))])  # pulled: room again
        while producer.has_unfinished_requests():
            finals |= {o.request_id: o for o in producer.step() if o.finished}
        assert finals["r1"].kv_transfer_params is not None
        assert producer.stats().num_prompt_tokens == 128  # each prompt computed once
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_a_peer_gone_before_the_pull_leaves_the_decode_side_computing(model_dir: Path, tmp_path: Path,
                                                                     transport: str) -> None:
    prompts = prompts_of([40, 50], seed=6)
    single = run(engine(model_dir, "both", tmp_path), [(rid, p, GREEDY, None) for rid, p in prompts.items()])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path, kv_transport=transport, kv_transfer_timeout=5.0)
    try:
        staged = prefill(producer, prompts)
    finally:
        producer.shutdown()  # its staged files and its KV server are gone
    try:
        pair = run(consumer, [(rid, p, GREEDY, KVImport(staged[rid])) for rid, p in prompts.items()])
        assert tokens(pair) == tokens(single)
        stats = consumer.stats()
        assert (stats.kv_imports, stats.kv_import_failures) == (0, 2)
        assert stats.num_prompt_tokens == 90 - 2 * 0  # both prompts computed here, whole
    finally:
        consumer.shutdown()


class _HeldTransport(SharedMemoryTransport):
    """Holds every pull until released: the transfer is in flight while the test acts."""

    def __init__(self, directory: Path) -> None:
        super().__init__(str(directory))
        self.release = threading.Event()
        self.started = threading.Event()

    def pull(self, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
        self.started.set()
        assert self.release.wait(10.0)
        return super().pull(*args, **kwargs)


def test_abort_while_receiving_frees_blocks_only_after_the_pull(model_dir: Path, tmp_path: Path) -> None:
    prompt = prompts_of([70], seed=7)["r0"]
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path)
    held = _HeldTransport(tmp_path)
    assert isinstance(consumer.kv_transfer, DecodeTransfer)
    consumer.kv_transfer.transport = held
    try:
        staged = prefill(producer, {"r0": prompt})["r0"]
        consumer.add_request(prompt, GREEDY, request_id="r0", kv_transfer=KVImport(staged))
        consumer.step()
        request = consumer.scheduler.receiving[0]
        assert request.status is RequestStatus.RECEIVING and held.started.wait(10.0)
        consumer.abort_request("r0")
        assert request.is_finished and len(request.block_ids) == 5  # still the pull's to write
        consumer.check_integrity()
        held.release.set()
        while consumer.has_unfinished_requests():
            consumer.step()
        consumer.check_integrity()
        assert request.block_ids == [] and consumer.kv_manager.pool.num_used_blocks == \
            consumer.kv_manager.prefix_cache.num_cached_blocks
    finally:
        held.release.set()
        producer.shutdown()
        consumer.shutdown()


def test_mismatched_layouts_are_refused(model_dir: Path, tmp_path: Path) -> None:
    prompt = prompts_of([40], seed=8)["r0"]
    single = run(engine(model_dir, "both", tmp_path, block_size=32), [("r0", prompt, GREEDY, None)])
    producer = engine(model_dir, "prefill", tmp_path)  # block size 16
    consumer = engine(model_dir, "decode", tmp_path, block_size=32)
    try:
        staged = prefill(producer, {"r0": prompt})["r0"]
        pair = run(consumer, [("r0", prompt, GREEDY, KVImport(staged))])
        assert tokens(pair) == tokens(single)  # refused, so computed here
        assert consumer.stats().kv_import_failures == 1 and consumer.stats().kv_imports == 0
        # The torch transport's handshake refuses the pair itself, naming the difference.
        with pytest.raises(TransferFailed, match="cannot share KV: block_size 16 here, 32 there"):
            TorchTransport(consumer.kv_layout, 5.0).pull(staged, 0, 1, consumer.runner.kv_caches, [0], True)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_forged_staged_path_is_neither_read_nor_removed(model_dir: Path, tmp_path: Path) -> None:
    """A descriptor comes from whoever sent the request. One that names any file but a
    staged one of its prefill instance in this instance's --kv-shm-dir (a client's
    file, a staged file's name in another directory, a real staged file under another
    entry's number) is refused when the request arrives: the file is left alone and the
    prompt computed here. (The decode instance used to map such a file into its pool
    and delete it.)"""
    prompt = prompts_of([40], seed=9)["r0"]
    single = run(engine(model_dir, "both", tmp_path), [("r0", prompt, GREEDY, None)])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path)
    try:
        staged = prefill(producer, {"r0": prompt})["r0"]
        victim = tmp_path / "victim.bin"
        victim.write_bytes(Path(staged.path).read_bytes())  # the right size, so only the path is wrong
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        moved = outside / Path(staged.path).name
        moved.write_bytes(victim.read_bytes())
        forged = [dataclasses.replace(staged, path=str(victim)),
                  dataclasses.replace(staged, path=str(moved)),
                  dataclasses.replace(staged, index=staged.index + 1)]
        for number, spec in enumerate(forged):
            pair = run(consumer, [(f"f{number}", prompt, GREEDY, KVImport(spec))])
            assert [out.outputs[0].token_ids for out in pair.values()] == list(tokens(single).values())
        assert victim.exists() and moved.exists() and Path(staged.path).exists()
        assert consumer.stats().kv_import_failures == 3 and consumer.stats().kv_imports == 0
        # The real descriptor still serves, and its file goes after the last pull.
        assert tokens(run(consumer, [("r0", prompt, GREEDY, KVImport(staged))])) == tokens(single)
        assert consumer.stats().kv_imports == 1 and not Path(staged.path).exists()
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_roles_refuse_what_they_do_not_serve(model_dir: Path, tmp_path: Path) -> None:
    both = engine(model_dir, "both", tmp_path)
    with pytest.raises(ValueError, match="--role both; a request that stages its KV needs --role prefill"):
        both.add_request([1, 2, 3], GREEDY, kv_transfer=KVExport())
    with pytest.raises(ValueError, match="disaggregated"):
        EngineConfig.from_kwargs(str(model_dir), role="disaggregated")
    with pytest.raises(ValueError, match="kv_buffer_gib must be > 0"):
        EngineConfig.from_kwargs(str(model_dir), role="prefill", kv_buffer_gib=0)


def start_prefill_child(model_dir: Path, shm_dir: Path, mode: str,
                        prompts: dict[str, list[int]]) -> tuple[subprocess.Popen[str], dict[str, StagedKV]]:
    child = subprocess.Popen([sys.executable, str(Path(__file__).with_name("prefill_child.py")), str(model_dir),
                              str(shm_dir), mode, json.dumps(list(prompts.values()))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"the prefill child exited with {child.wait()}"
    return child, {rid: StagedKV.from_dict(entry) for rid, entry in zip(prompts, json.loads(line), strict=True)}


@pytest.mark.parametrize("mode", ["killed", "die-mid-pull"])
def test_a_prefill_process_that_dies_fails_the_pull_cleanly(model_dir: Path, tmp_path: Path, mode: str) -> None:
    """torch transport: the prefill process is SIGKILLed before the pull, or dies in the
    middle of it (after promising the blocks): the decode side notices at once (the
    connection closes), computes those prompts itself and leaks nothing."""
    prompts = prompts_of([40, 50], seed=9)
    single = run(engine(model_dir, "both", tmp_path), [(rid, p, GREEDY, None) for rid, p in prompts.items()])
    child, staged = start_prefill_child(model_dir, tmp_path, "serve" if mode == "killed" else mode, prompts)
    consumer = engine(model_dir, "decode", tmp_path, kv_transport="torch", kv_transfer_timeout=60.0)
    try:
        if mode == "killed":
            child.send_signal(signal.SIGKILL)
            child.wait()
        pair = run(consumer, [(rid, p, GREEDY, KVImport(staged[rid])) for rid, p in prompts.items()])
        assert tokens(pair) == tokens(single)
        assert consumer.stats().kv_import_failures == 2 and consumer.stats().kv_imports == 0
        assert child.wait(timeout=30) in (9, -signal.SIGKILL)
    finally:
        child.kill()
        consumer.shutdown()
    # Its staged files outlived it; the next prefill instance here removes them.
    assert len(list(tmp_path.iterdir())) == 2
    assert remove_orphans(str(tmp_path)) == 2 and list(tmp_path.iterdir()) == []


def test_the_batch_keeps_stepping_while_blocks_arrive(model_dir: Path, tmp_path: Path) -> None:
    """A pull runs on the transfer thread: the decode instance's running requests get a
    token every step while another request's KV is still arriving."""
    prompts = prompts_of([30, 70], seed=10)
    single = run(engine(model_dir, "both", tmp_path), [(rid, p, GREEDY, None) for rid, p in prompts.items()])
    producer = engine(model_dir, "prefill", tmp_path)
    consumer = engine(model_dir, "decode", tmp_path)
    held = _HeldTransport(tmp_path)
    assert isinstance(consumer.kv_transfer, DecodeTransfer)
    try:
        staged = prefill(producer, prompts)
        finals: dict[str, RequestOutput] = {}
        consumer.add_request(prompts["r0"], GREEDY, request_id="r0", kv_transfer=KVImport(staged["r0"]))
        while not consumer.scheduler.running:  # r0's pull (unheld) arrives
            consumer.step()
        consumer.kv_transfer.transport = held
        consumer.add_request(prompts["r1"], GREEDY, request_id="r1", kv_transfer=KVImport(staged["r1"]))
        outputs = consumer.step()
        assert held.started.wait(10.0)
        for _ in range(3):  # r1 receiving, held: r0 decodes on
            assert [o.request_id for o in outputs] == ["r0"]
            assert consumer.scheduler.receiving[0].request_id == "r1"
            outputs = consumer.step()
            consumer.check_integrity()
        held.release.set()
        while consumer.has_unfinished_requests():
            finals |= {o.request_id: o for o in consumer.step() if o.finished}
            consumer.check_integrity()
        assert tokens(finals) == tokens(single)
    finally:
        held.release.set()
        producer.shutdown()
        consumer.shutdown()


def native_threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


def test_a_pull_leaves_no_openmp_team_on_the_import_thread(model_dir: Path, tmp_path: Path) -> None:
    """The pull's copy into the pool is parallel (a 400-token prompt: 25 blocks); its
    OpenMP team on the kv-import thread is released after it, or libgomp, managing more
    threads than there are cores, would throttle every later step of the engine."""
    prompts = prompts_of([400])
    producer = engine(model_dir, "prefill", tmp_path, num_blocks=64)
    consumer = engine(model_dir, "decode", tmp_path, num_blocks=64, kv_transport="shm")
    try:
        staged = prefill(producer, prompts)
        before = native_threads()
        pair = run(consumer, [(rid, p, GREEDY, KVImport(staged[rid])) for rid, p in prompts.items()])
        assert consumer.stats().kv_imports == 1 and len(pair) == 1
        assert native_threads() == before
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_lora_adapters_decode_across_the_pair_and_keep_their_kv_apart(model_dir: Path, tmp_path: Path,
                                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each request's prompt KV is computed with its LoRA adapter on the prefill side and
    decoded with it on the decode side: the tokens of one instance with both adapters.
    KV staged for one adapter is refused for a request on another (or on the base
    model), which then computes its prompt itself: the tokens are that adapter's still."""
    from helpers_lora import TARGETS_ALL, write_adapter

    from kvloom.lora.request import LoRARequest
    root = tmp_path_factory.mktemp("pd-adapters")
    a = LoRARequest("a", 1, str(write_adapter(model_dir, root / "a", 1, 8, TARGETS_ALL)))
    b = LoRARequest("b", 2, str(write_adapter(model_dir, root / "b", 2, 4, ["q_proj", "v_proj", "down_proj"])))
    prompts = prompts_of([5, 17, 33, 40], seed=3)
    loras = dict(zip(prompts, [a, b, None, a], strict=True))
    lora_kwargs = dict(enable_lora=True, max_lora_rank=8)
    single = run(engine(model_dir, "both", tmp_path, **lora_kwargs),
                 [(rid, p, GREEDY, None) for rid, p in prompts.items()], loras)
    assert len({tuple(o.outputs[0].token_ids) for rid, o in single.items() if rid != "r3"}) == 3  # adapters differ
    producer = engine(model_dir, "prefill", tmp_path, **lora_kwargs)
    consumer = engine(model_dir, "decode", tmp_path, **lora_kwargs)
    try:
        staged = {rid: StagedKV.from_dict(out.kv_transfer_params) for rid, out in run(
            producer, [(rid, p, SamplingParams(max_tokens=1), KVExport()) for rid, p in prompts.items()],
            loras).items()}
        assert [staged[rid].adapter for rid in prompts] == ["a", "b", None, "a"]
        pair = run(consumer, [(rid, p, GREEDY, KVImport(staged[rid])) for rid, p in prompts.items()], loras)
        assert tokens(pair) == tokens(single)
        assert (consumer.stats().kv_imports, consumer.stats().kv_import_failures) == (4, 0)
        # r1's prompt staged again with b, r2's with the base model (the first ones are
        # dropped once pulled), offered to a request on a and to one on b.
        again = {rid: StagedKV.from_dict(out.kv_transfer_params) for rid, out in run(
            producer, [("x", prompts["r1"], SamplingParams(max_tokens=1), KVExport()),
                       ("y", prompts["r2"], SamplingParams(max_tokens=1), KVExport())], {"x": b}).items()}
        crossed = run(consumer, [("x", prompts["r1"], GREEDY, KVImport(again["x"])),
                                 ("y", prompts["r2"], GREEDY, KVImport(again["y"]))], {"x": a, "y": b})
        assert consumer.stats().kv_import_failures == 2
        alone = run(engine(model_dir, "both", tmp_path, **lora_kwargs),
                    [("x", prompts["r1"], GREEDY, None), ("y", prompts["r2"], GREEDY, None)], {"x": a, "y": b})
        assert tokens(crossed) == tokens(alone)
    finally:
        producer.shutdown()
        consumer.shutdown()
