"""`kvloom chat`: an interactive terminal chat that streams tokens as they come."""

from __future__ import annotations

import sys
from typing import Any

from kvloom.sampling_params import SamplingParams


def run_chat(model: str, engine_args: dict[str, Any], params: SamplingParams,
             system: str | None) -> int:
    from kvloom.engine.llm import LLM

    llm = LLM(model, **engine_args)
    engine = llm.engine
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print(f"kvloom chat with {engine.model_name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        engine.add_request(llm.encode_chat(history), params)
        reply = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                delta = output.outputs[0].delta_text
                reply += delta
                sys.stdout.write(delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
