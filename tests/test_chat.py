"""`kvloom chat`: Ctrl-C during a reply stops that reply alone; Ctrl-C at the prompt quits."""

from __future__ import annotations

import io
import json

from kvloom import LLM, SamplingParams
from kvloom.chat import chat_loop


def test_ctrl_c_stops_the_reply_then_quits(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=64)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    engine, step = llm.engine, llm.engine.step
    steps = {"n": 0}

    def step_with_ctrl_c():  # the user presses Ctrl-C on the second step of the first reply
        steps["n"] += 1
        if steps["n"] == 2:
            raise KeyboardInterrupt
        return step()

    engine.step = step_with_ctrl_c
    conversations: list[str] = []
    encode_chat = llm.encode_chat
    llm.encode_chat = lambda history, *args: (conversations.append(json.dumps(history)),
                                              encode_chat(history, *args))[1]
    lines = iter(["hello", "again"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None  # Ctrl-C at the prompt

    out = io.StringIO()
    assert chat_loop(llm, params, None, read=read, out=out) == 0
    assert out.getvalue().count("[stopped]") == 1
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_available_blocks == engine.num_blocks  # the aborted reply freed its blocks
    engine.check_integrity()
    # The second reply is whole: what the offline API answers to the same conversation.
    second = json.loads(conversations[1])
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    engine.step = step
    reference = llm.generate([encode_chat(second)], params)[0].outputs[0].text
    assert reference and out.getvalue().rstrip("\n").endswith(reference)
