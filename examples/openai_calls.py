"""The workloads of examples/lang_programs.py written without kvloom.lang: the same
logic as independent OpenAI API calls (the ``openai`` client) against a server, what a
vLLM user writes today. The baseline the programs are measured against.

    kvloom serve --port 8000 &                       # or with --no-prefix-cache
    python examples/openai_calls.py --endpoint http://127.0.0.1:8000
    python examples/openai_calls.py --endpoint http://127.0.0.1:8000 --workload multi_turn

What differs from the program is only how the logic reaches the engine:
- few_shot: each choice is its own completion with vLLM's ``prompt_logprobs`` (the
  three sent at once); the choice's score is the sum of its tokens' logprobs, from the
  first token where prompt + choice tokenizes differently from the prompt (server-side
  ``/tokenize``), as kvloom.lang's select. A request for prompt logprobs needs every
  prompt position's logits, so the prefix cache serves it nothing (vLLM: the same).
- tree_of_thought: each branch is a chat completion carrying the conversation so far;
  a branch's "Approach i: " prefill is the assistant message continued
  (``continue_final_message``). The forks are threads, as the program's are.
- multi_turn: four streamed chat completions, each with the whole history.
- json_extraction: a chat completion with ``response_format`` json_schema.

Output: one JSON line per workload, as lang_programs.py prints (``style`` "openai").
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
from lang_programs import EXAMPLES, PERSON, SIZES, TURNS, WORKLOADS, server_counters, token_figures, ttft_by_turn

LABELS = ["positive", "negative", "neutral"]
Message = dict[str, str]


def parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls at once, each on its own thread, as a program's forks run."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


class Calls:
    """One server, through the OpenAI client (and ``/tokenize``, which vLLM has too)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key="none", max_retries=0, timeout=600.0)
        self.http = httpx.Client(base_url=self.base_url, timeout=600.0,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.model = self.client.models.list().data[0].id

    def tokenize(self, text: str) -> list[int]:
        response = self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        return list(response.json()["tokens"])

    def choice_logprob(self, prompt: str, choice: str) -> float:
        prefix, full = self.tokenize(prompt), self.tokenize(prompt + choice)
        start = next((i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b), len(prefix))
        answer = self.client.completions.create(model=self.model, prompt=full, max_tokens=1, temperature=0.0,
                                                extra_body={"prompt_logprobs": 0})
        entries = answer.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
        return sum(entries[i][str(full[i])]["logprob"] for i in range(max(1, start), len(full)))

    def chat(self, messages: list[Message], max_tokens: int, temperature: float = 0.0, **extra: Any) -> str:
        continued = messages[-1]["role"] == "assistant"
        body = {"continue_final_message": True, "add_generation_prompt": False} if continued else {}
        answer = self.client.chat.completions.create(model=self.model, messages=messages,  # type: ignore[arg-type]
                                                     max_tokens=max_tokens, temperature=temperature,
                                                     extra_body=body, **extra)
        return answer.choices[0].message.content or ""

    def chat_stream(self, messages: list[Message], max_tokens: int) -> tuple[str, float | None]:
        """A streamed chat completion: its text and the time to its first text."""
        started = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        stream = self.client.chat.completions.create(model=self.model, messages=messages,  # type: ignore[arg-type]
                                                     max_tokens=max_tokens, temperature=0.0, stream=True)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    if first is None:
                        first = time.perf_counter() - started
                    pieces.append(choice.delta.content)
        return "".join(pieces), first


def few_shot(c: Calls, review: str) -> dict[str, Any]:
    prompt = "Classify the sentiment of each review.\n\n"
    prompt += "".join(f"Review: {text}\nSentiment: {label}\n\n" for text, label in EXAMPLES)
    prompt += f"Review: {review}\nSentiment: "
    scores = parallel([lambda label=label: c.choice_logprob(prompt, label) for label in LABELS])
    best = max(range(len(LABELS)), key=scores.__getitem__)
    return {"label": LABELS[best], "scores": dict(zip(LABELS, scores, strict=True))}


def tree_of_thought(c: Calls, question: str) -> dict[str, Any]:
    asked = [{"role": "system", "content": "You think step by step."},
             {"role": "user", "content": f"{question} Propose an approach."}]

    def branch(i: int) -> dict[str, Any]:
        lead = f"Approach {i + 1}: "
        idea = c.chat([*asked, {"role": "assistant", "content": lead}], max_tokens=24, temperature=0.8)
        said = [*asked, {"role": "assistant", "content": lead + idea}]
        refined = parallel([lambda j=j: c.chat([*said, {"role": "user", "content": f"Refine it ({j + 1})."}],
                                               max_tokens=24, temperature=0.8) for j in range(3)])
        return {"idea": idea, "refined": refined}

    return {"ideas": parallel([lambda i=i: branch(i) for i in range(3)])}


def multi_turn(c: Calls, topic: str) -> dict[str, Any]:
    messages: list[Message] = [{"role": "system", "content": "You are a concise assistant."}]
    first_text_s: list[float | None] = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Tell me one more fact about {topic} (fact {turn + 1})."})
        answer, first = c.chat_stream(messages, max_tokens=32)
        messages.append({"role": "assistant", "content": answer})
        first_text_s.append(first)
    return {**{f"answer{t}": messages[2 + 2 * t]["content"] for t in range(TURNS)}, "first_text_s": first_text_s}


def json_extraction(c: Calls, text: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You extract data as JSON."},
                {"role": "user", "content": f"Extract the person as JSON (name, age, city): {text}"}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return {"person": c.chat(messages, max_tokens=96, response_format=schema)}


BASELINES: dict[str, Callable[..., dict[str, Any]]] = {
    "few_shot": few_shot, "tree_of_thought": tree_of_thought, "multi_turn": multi_turn,
    "json_extraction": json_extraction}


def run_batch(c: Calls, workload: str, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every input's logic at once, each on its own thread (as ``run_batch`` runs programs)."""
    logic = BASELINES[workload]
    return parallel([lambda kwargs=kwargs: logic(c, **kwargs) for kwargs in inputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="a kvloom serve URL")
    parser.add_argument("--workload", choices=[*BASELINES, "all"], default="all")
    parser.add_argument("--num", type=int, default=None, help="inputs per workload")
    args = parser.parse_args()
    calls = Calls(args.endpoint)
    for name in BASELINES if args.workload == "all" else [args.workload]:
        inputs = WORKLOADS[name][1](args.num or SIZES[name])
        before = server_counters(args.endpoint)
        started = time.perf_counter()
        results = run_batch(calls, name, inputs)
        seconds = time.perf_counter() - started
        line: dict[str, Any] = {"workload": name, "style": "openai", "backend": "endpoint", "programs": len(inputs),
                                "seconds": round(seconds, 2), "programs_per_s": round(len(inputs) / seconds, 3),
                                **token_figures(before, server_counters(args.endpoint), seconds)}
        if name == "multi_turn":
            line["ttft_ms_by_turn"] = ttft_by_turn([r["first_text_s"] for r in results])
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
