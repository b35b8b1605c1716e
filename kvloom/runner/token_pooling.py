"""Token pooling: for pooling requests that read every prompt token
(``SamplingParams.pooling`` "token_embed" or "token_classify", vLLM's ``ALL`` pooling; an
"embed" request of a model that pools by the mean or the first token), each prompt
position's vector from the step that computed it.

A step's chunk ``[start, end)`` of a request's prompt holds positions ``start .. end - 1``'s
final hidden states; each chunk adds its slice, and a prompt computed in several chunks
(or again after preemption) yields every position once the output processor has kept
each (its rows are the same bits whichever step computes them: the kernels are
batch-invariant). The scheduler gives such a request no prefix-cache hit.
"""

from __future__ import annotations

import torch

from kvloom.batch import SchedulerOutput
from kvloom.models.registry import CausalLM


def token_pooling(model: CausalLM, hidden: torch.Tensor, output: SchedulerOutput,
                  normalize: bool = True) -> list[tuple[str, int, torch.Tensor]]:
    """(request id, first prompt position, [count, width] float32 vectors) of every chunk
    this step computed for a request that pools every token (``Request.pools_every_token``;
    hidden: the step's [tokens, hidden] final states, every row, in schedule order).
    "token_embed": each position's state, L2-normalized where the pooler ``normalize``s;
    "token_classify": the score head's class logits at each position; "embed" (pooled by
    the mean or the first token, which the output processor takes): the states as they are."""
    found: list[tuple[str, int, torch.Tensor]] = []
    offset = 0
    for item in output.scheduled:
        request = item.request
        task = request.sampling_params.pooling
        end = min(item.start + item.num_new_tokens, request.num_prompt_tokens)  # prompt positions only
        if request.pools_every_token and item.start < end:
            rows = hidden[offset:offset + end - item.start]
            if task == "token_classify":
                vectors = model.compute_logits(rows).float()
            elif task == "token_embed" and normalize:
                vectors = torch.nn.functional.normalize(rows.float(), dim=-1)
            else:
                vectors = rows.float()
            found.append((request.request_id, item.start, vectors))
        offset += item.num_new_tokens
    return found
