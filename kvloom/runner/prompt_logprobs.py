"""Prompt logprobs: for requests that ask (``SamplingParams.prompt_logprobs``), the
logprob of every prompt token under the tokens before it, with the top alternatives.

A step's chunk ``[start, end)`` of a request's prompt has the hidden states that predict
prompt tokens ``start + 1 .. min(end, P)``: position p's logits score token p + 1. So
each chunk adds its own slice, and a prompt computed in several chunks (or again after
preemption) yields every position; the output processor keeps each position once.
"""

from __future__ import annotations

import torch

from kvloom.batch import LogprobsEntry, PromptLogprobs, SchedulerOutput
from kvloom.models.registry import CausalLM


def prompt_logprobs(model: CausalLM, hidden: torch.Tensor, output: SchedulerOutput) -> dict[str, PromptLogprobs]:
    """The prompt logprobs this step's chunks computed, by request id (hidden: the
    step's [tokens, hidden] final states, in schedule order)."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []  # (request id, first position, count, top n)
    offset = 0
    for item in output.scheduled:
        request = item.request
        top_n = request.sampling_params.prompt_logprobs
        # Positions before prompt_logprobs_start - 1 score tokens nobody asked for.
        start = max(item.start, request.sampling_params.prompt_logprobs_start - 1)
        last = min(item.start + item.num_new_tokens, request.num_prompt_tokens - 1)  # last predicting position + 1
        if top_n is not None and start < last:
            rows.extend(range(offset + start - item.start, offset + last - item.start))
            targets.extend(request.prompt_token_ids[start + 1:last + 1])
            spans.append((request.request_id, start + 1, last - start, top_n))
        offset += item.num_new_tokens
    if not rows:
        return {}
    index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
    logprobs = torch.log_softmax(model.compute_logits(hidden[index]).float(), dim=-1)  # [R, V]
    target = torch.tensor(targets, dtype=torch.int64, device=hidden.device).unsqueeze(1)
    target_logprobs = logprobs.gather(1, target)  # [R, 1]
    ranks = ((logprobs > target_logprobs).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(max(n for *_, n in spans), dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    values = target_logprobs.squeeze(1).tolist()
    result: dict[str, PromptLogprobs] = {}
    row = 0
    for request_id, first, count, top_n in spans:
        result[request_id] = PromptLogprobs(first, [
            LogprobsEntry(targets[r], values[r], ranks[r], list(zip(top_ids[r][:top_n], top_values[r][:top_n],
                                                                   strict=True)))
            for r in range(row, row + count)])
        row += count
    return result
