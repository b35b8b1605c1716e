"""A --role prefill engine in a child process, for the tests of a peer that dies: it
stages the prompts given on the command line, prints their StagedKV descriptors as one
JSON line, then serves pulls until stdin closes or it is killed. With ``die-mid-pull``
it dies (exit 9) while answering the first pull, after saying the blocks will follow."""

from __future__ import annotations

import json
import os
import sys

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.kv_spec import KVExport
from kvloom.kv_transfer.transport import KVServer
from kvloom.sampling_params import SamplingParams


def main() -> None:
    model, shm_dir, mode, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    if mode == "die-mid-pull":
        def die_after_answering(self: KVServer, number: int, key: str) -> None:
            self.store.set(f"answer/{key}", "1")  # "the blocks follow" ...
            os._exit(9)  # ... and they never do

        KVServer._answer = die_after_answering  # type: ignore[method-assign]
    engine = LLMEngine(EngineConfig.from_kwargs(model, role="prefill", num_blocks=64, kv_shm_dir=shm_dir))
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=str(index), kv_transfer=KVExport())
    staged: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                staged[output.request_id] = output.kv_transfer_params
    print(json.dumps([staged[str(i)] for i in range(len(prompts))]), flush=True)
    sys.stdin.read()
    engine.shutdown()


if __name__ == "__main__":
    main()
