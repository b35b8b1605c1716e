"""`kvloom chat`: an interactive terminal chat that streams tokens as they come.

Ctrl-C while a reply streams stops that reply (its request is aborted, its blocks
freed; the partial reply stays in the history); Ctrl-C at the prompt, an empty line
or Ctrl-D quits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from kvloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvloom.engine.llm import LLM


def run_chat(model: str, engine_args: dict[str, Any], params: SamplingParams,
             system: str | None) -> int:
    from kvloom.engine.llm import LLM

    with LLM(model, **engine_args) as llm:
        return chat_loop(llm, params, system)


def chat_loop(llm: LLM, params: SamplingParams, system: str | None,
              read: Callable[[str], str] | None = None, out: TextIO | None = None) -> int:
    """Read a line, stream the reply, until the user quits. ``read`` (default: input)
    and ``out`` (default: sys.stdout) are looked up at call time, for tests."""
    read = read or input
    out = out or sys.stdout
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print(f"kvloom chat with {llm.engine.model_name} (empty line, Ctrl-D or Ctrl-C to quit; "
          "Ctrl-C during a reply stops it)", file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        history.append({"role": "assistant", "content": stream_reply(llm, history, params, out)})


def stream_reply(llm: LLM, history: list[dict[str, str]], params: SamplingParams, out: TextIO) -> str:
    """Stream one reply to ``out``; Ctrl-C stops it and returns what was said so far."""
    engine = llm.engine
    request = engine.add_request(llm.encode_chat(history), params)
    reply = ""
    try:
        while not request.is_finished:
            for output in engine.step():
                delta = output.outputs[0].delta_text
                reply += delta
                out.write(delta)
                out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request.request_id)
        out.write(" [stopped]")
    out.write("\n")
    return reply
