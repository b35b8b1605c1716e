"""A naive beam search over a transformers model, the reference for kvloom's (vLLM's
rules, written out from their description, every beam recomputed whole each round)."""

from __future__ import annotations

import torch

Beam = tuple[list[int], float, str]  # generated tokens, summed log-probability, finish reason


def naive_beam_search(model: torch.nn.Module, prompt: list[int], width: int, max_tokens: int,
                      eos: set[int], length_penalty: float) -> list[Beam]:
    """Each round every live beam's 2 x width best next tokens (log-softmax of its full
    forward's last logits); an EOS token ends a beam; the width best of the rest by
    cum / (prompt + generated - a final EOS) ** length_penalty live on. At the end the
    width best of the ended and the live beams, best first."""
    def score(beam: Beam) -> float:
        tokens, cum, reason = beam
        return cum / ((len(prompt) + len(tokens) - (reason == "stop")) ** length_penalty)

    live: list[Beam] = [([], 0.0, "length")]
    ended: list[Beam] = []
    for _ in range(max_tokens):
        grown: list[Beam] = []
        for tokens, cum, _reason in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.topk(torch.log_softmax(logits.float(), dim=-1), 2 * width)
            for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if token in eos:
                    ended.append((tokens + [token], cum + value, "stop"))
                else:
                    grown.append((tokens + [token], cum + value, "length"))
        live = sorted(grown, key=score, reverse=True)[:width]
        if not live:
            break
    return sorted(ended + live, key=score, reverse=True)[:width]
