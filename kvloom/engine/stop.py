"""Whether a request stops after the token it just appended: every stop condition in one place.

``Scheduler.update`` appends a step's tokens one at a time (the sampled one, then any
a grammar forces) and asks ``StopChecker.check`` after each; at the first stop it
finishes the request and appends nothing more. So no token after a stop is ever
appended, and no one deletes tokens afterwards.

Order of the checks, for the one token: a grammar's EOS (always ends the request),
then stop token ids and EOS (from ``min_tokens`` on, EOS unless ``ignore_eos``),
then stop strings (matched on the detokenized text), then ``max_tokens`` and the
model's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvloom.request import Request, RequestStatus


class TokenText(Protocol):
    """The request's output text, kept by whoever detokenizes (the output processor)."""

    def add_token(self, request: Request, token_id: int) -> str | None:
        """Detokenize the request's newest token; returns the stop string that its text
        now contains (the text is cut there), or None."""
        ...


class NoText:
    """For a scheduler without a tokenizer (tests): no text, so no stop strings."""

    def add_token(self, request: Request, token_id: int) -> str | None:
        return None


@dataclass(frozen=True, slots=True)
class Stop:
    status: RequestStatus
    reason: int | str | None = None  # the stop token id or stop string that matched


class StopChecker:
    def __init__(self, text: TokenText | None = None) -> None:
        self.text: TokenText = text if text is not None else NoText()

    def check(self, request: Request, token_id: int) -> Stop | None:
        """Called once per appended output token, in order: does the request stop here?
        Every appended token is detokenized except one that stops the request by itself
        (EOS, a stop token id): as vLLM's, its id is output and its text is not, unless
        ``include_stop_str_in_output`` (what shows with ``skip_special_tokens`` false, or a
        stop token id of an ordinary token)."""
        params = request.sampling_params
        stop = self._token_stop(request, token_id)
        if stop is not None:
            if params.include_stop_str_in_output:
                self.text.add_token(request, token_id)
            return stop
        stop_string = self.text.add_token(request, token_id)
        if stop_string is not None:
            return Stop(RequestStatus.FINISHED_STOPPED, stop_string)
        if request.num_output_tokens >= request.max_tokens:
            return Stop(RequestStatus.FINISHED_LENGTH)
        return None

    @staticmethod
    def _token_stop(request: Request, token_id: int) -> Stop | None:
        params = request.sampling_params
        if params.structured is not None and token_id in request.eos_token_ids:
            # A grammar admits EOS only once its structure is complete: that always ends
            # the request, whatever ignore_eos and min_tokens say.
            return Stop(RequestStatus.FINISHED_STOPPED)
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return Stop(RequestStatus.FINISHED_STOPPED, token_id)
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return Stop(RequestStatus.FINISHED_STOPPED)
        return None
