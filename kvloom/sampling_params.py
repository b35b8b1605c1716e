"""Per-request sampling parameters, validated once at construction.

Every bad value raises ``ValueError`` naming the field, so the offline API, the
CLI and the HTTP server all report the same message for the same mistake.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

from kvloom.structured.constraint import StructuredOutput, StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows.
GREEDY_EPSILON = 1e-5
# Seeds are 64-bit: [0, 2**64), and a negative seed s in [-2**63, 0) means s + 2**64
# (its two's-complement bits), the value the request's generator is seeded with.
SEED_MIN, SEED_END = -(1 << 63), 1 << 64
# Caps on what a request may ask the stop checks to do per token (named in the error).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's limits on logit_bias: each bias in [-100, 100], at most this many tokens.
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# bad_words: at most this many words, of stop strings' length (each checked every step).
MAX_BAD_WORDS = 64
# SamplingParams.pooling: what a pooling request reads (vLLM's pooling tasks): at its
# prompt's last token, or at every token of its prompt (the TOKEN_POOLING_TASKS).
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
TOKEN_POOLING_TASKS = ("token_embed", "token_classify")


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request gets from ``LLMEngine.step`` (vLLM's names and values)."""

    CUMULATIVE = 0  # one per step it moved: everything so far, and the step's deltas
    DELTA = 1  # one per step it moved: text, token_ids and logprobs hold the step's new part only
    # One output, when it finishes. Nothing per step is built, and where no stop string
    # needs the text per token, the output is detokenized once at the end (LLM.generate).
    FINAL_ONLY = 2


def seed_value(seed: int) -> int:
    """The unsigned 64-bit value a (validated) seed stands for."""
    return seed + SEED_END if seed < 0 else seed


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample ``sample`` of an ``n > 1`` request: ``seed + sample``, wrapped
    to 64 bits (so a seed near 2**64 stays valid)."""
    return None if seed is None else (seed_value(seed) + sample) % SEED_END


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of the ``n`` engine requests behind one ``n > 1`` request (one
    per sample, ``n=1``, sample ``s`` seeded ``sample_seed(seed, s)``); ``[params]`` when
    ``n == 1``. ``LLM.generate`` and the server both fan out through here."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=sample_seed(params.seed, sample))
            for sample in range(params.n)]


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """At most ``tokens`` tokens of reasoning (vLLM's ``thinking_token_budget``): an output
    whose reasoning has run ``tokens`` tokens without its end marker, ``end_token_id``,
    takes that marker as its next token, whatever the model or the sampling would choose
    there, and goes on with its answer; 0 closes the reasoning at once. Where the chat
    template opened the reasoning, every output token before the marker counts. Where
    the model opens it itself (``start_token_id``, Mistral's ``[THINK]``), only an output
    that begins with that marker reasons, and the tokens after it count. The server
    builds it from ``--reasoning-parser``'s markers."""

    tokens: int
    end_token_id: int
    start_token_id: int | None = None

    def __post_init__(self) -> None:
        _check_int("thinking_budget.tokens", self.tokens, minimum=0)
        _check_int("thinking_budget.end_token_id", self.end_token_id, minimum=0)
        if self.start_token_id is not None:
            _check_int("thinking_budget.start_token_id", self.start_token_id, minimum=0)

    def forced(self, output_token_ids: list[int]) -> int | None:
        """The token the next position must take: the end marker where the reasoning has
        reached the budget without it; else None. (Past the budget the marker is always
        there: it was forced where the budget ran out if it had not come before.)"""
        opened = 0
        if self.start_token_id is not None:
            if not output_token_ids or output_token_ids[0] != self.start_token_id:
                return None  # no reasoning (yet): nothing to cap
            opened = 1
        if len(output_token_ids) == opened + self.tokens and self.end_token_id not in output_token_ids:
            return self.end_token_id
        return None


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM-compatible names and meanings).

    top_k=0 or -1 disables top-k; top_p=1 disables nucleus; min_p=0 disables min-p.
    max_tokens=None generates up to the context, or up to what the whole KV pool holds
    when that is less (the engine fills it in when the request is added).
    presence/frequency penalties follow OpenAI (subtract from logits of tokens already
    generated); repetition_penalty follows the CTRL paper (divide positive logits,
    multiply negative ones, for tokens in prompt or output).

    ``logit_bias`` maps token ids to a value in [-100, 100] added to that token's logit
    before sampling (OpenAI's semantics, greedy rows included): after the penalties,
    before min_tokens and the grammar mask, so -inf stays -inf; logprobs still come
    from the raw logits. The server's ``{"50256": -100}`` (string keys) is accepted too.

    ``allowed_token_ids`` (vLLM's) restricts every sampled token to these ids: the others'
    logits become -inf, after logit_bias. ``bad_words`` (vLLM's) are words the output may
    not contain, as tokens: each word is tokenized as it is and, where that gives other
    tokens of the same count, after a space (the form it takes mid-text); a word's last
    token is forbidden wherever the output so far ends with the tokens before it (a
    one-token word, always). ``LLMEngine.add_request`` fills ``bad_words_token_ids`` from
    them with its tokenizer (``tokenize_bad_words``); given directly, those sequences are
    used as they are.

    ``thinking_budget`` caps a thinking model's reasoning (``ThinkingBudget``): the end
    marker is forced where the budget runs out, after every other stage of the sampling.

    ``structured`` constrains the output to a JSON schema, regex, grammar or choice.
    The grammar then owns where the output ends: EOS is allowed exactly when the
    structure is complete and always stops the request (``ignore_eos`` and
    ``min_tokens`` do not apply to it); ``max_tokens`` still cuts it ("length").
    ``structured_outputs`` (vLLM's spelling, a ``StructuredOutputsParams``) sets it too.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (each under the tokens before it) with this many
    # alternatives (vLLM's). Such a request computes its prompt from token
    # ``prompt_logprobs_start - 1`` on (kvloom's): tokens before ``prompt_logprobs_start``
    # get no logprobs (None) and the prefix cache may serve them; 0, the default: the
    # whole prompt is computed, no prefix-cache hit (scoring continuations of one
    # prefix, as kvloom.lang's select does, computes the prefix once).
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    thinking_budget: ThinkingBudget | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A pooling request reads the final hidden state of its prompt's last token (vLLM's
    # last-token pooling for decoder models) into RequestOutput.pooled: "embed" (LLM.embed,
    # /v1/embeddings) that state L2-normalized; "classify" (LLM.classify, /classify, a
    # sequence-classification model only) the score head's class logits. It samples one
    # token at that position, which is dropped from the answer. "token_embed" and
    # "token_classify" (LLM.encode, /pooling) read every prompt token's state the same
    # way, one vector per token (the whole prompt computed: no prefix-cache hit).
    pooling: str | None = None
    structured_outputs: InitVar[StructuredOutputsParams | None] = None

    def __post_init__(self, structured_outputs: StructuredOutputsParams | None = None) -> None:
        if structured_outputs is not None:
            if not isinstance(structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(structured_outputs).__name__}")
            if self.structured is not None:
                raise ValueError("give structured or structured_outputs, not both")
            self.structured = structured_outputs.to_structured_output()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (dict, set)):  # list() would take its keys, in no set order
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):  # "no" would count as true
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("n", self.n, minimum=1)
        _check_number("temperature", self.temperature, 0.0, None)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=SEED_MIN)
            if self.seed >= SEED_END:
                raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, None)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, "
                                 f"got one of {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, minimum=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)  # the ceiling is the engine's max_logprobs
        if self.pooling is not None and self.pooling not in POOLING_TASKS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TASKS)} (or None), got {self.pooling!r}")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty: no token could be sampled")
        self.bad_words = _checked_bad_words(self.bad_words)
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)):
                raise ValueError(f"bad_words_token_ids must be a list of token-id lists, got "
                                 f"{self.bad_words_token_ids!r}")
            self.bad_words_token_ids = [_int_list("bad_words_token_ids", ids) for ids in self.bad_words_token_ids]
            if any(not ids for ids in self.bad_words_token_ids):
                raise ValueError("bad_words_token_ids must not hold an empty sequence")
        if self.thinking_budget is not None and not isinstance(self.thinking_budget, ThinkingBudget):
            raise ValueError(f"thinking_budget must be a ThinkingBudget, got {type(self.thinking_budget).__name__}")
        kinds = {kind.value: kind for kind in RequestOutputKind}
        if type(self.output_kind) not in (int, RequestOutputKind) or self.output_kind not in kinds:
            raise ValueError(f"output_kind must be a RequestOutputKind ({', '.join(kinds[v].name for v in kinds)}), "
                             f"got {self.output_kind!r}")
        self.output_kind = kinds[self.output_kind]
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(
                f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.structured is not None and self.allowed_token_ids is not None:
            # The two could leave no token at all; the grammar already chooses the tokens.
            raise ValueError("allowed_token_ids cannot be combined with structured output: the grammar "
                             "decides which tokens may come, and the two together could allow none")

    @property
    def defers_text(self) -> bool:
        """Whether the output's text may wait until the request finishes: it is reported
        only then, and no stop string needs it token by token."""
        return self.output_kind is RequestOutputKind.FINAL_ONLY and not self.stop

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def reads_previous_tokens(self) -> bool:
        """Whether sampling the next token needs the value of the last one on the host:
        penalties count the output, min_tokens and a thinking budget count it, a grammar
        advances on it. Overlap scheduling lets a step of such a request finish before
        the next is scheduled."""
        return (self.uses_penalties or self.min_tokens > 0 or self.structured is not None
                or bool(self.bad_words or self.bad_words_token_ids) or self.thinking_budget is not None)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _checked_logit_bias(value: object) -> dict[int, float]:
    """``{token id: bias}`` with int keys (JSON's string keys parsed), every bias finite
    and in [-100, 100]; ValueError naming logit_bias otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {value!r}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}")
    checked: dict[int, float] = {}
    for key, bias in value.items():
        token_id = key
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            token_id = int(key)
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        _check_number("logit_bias", bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        checked[token_id] = float(bias)  # type: ignore[arg-type]
    return checked


def _int_list(name: str, value: object) -> list[int]:
    """``value`` as a list of token ids (non-negative integers); ValueError naming ``name``."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for token_id in value:
        _check_int(name, token_id, minimum=0)
    return list(value)


def _checked_bad_words(value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {value!r}")
    if len(value) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(value)}")
    for word in value:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words must be non-empty strings, got {word!r}")
        if len(word) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"bad_words may be at most {MAX_STOP_STRING_CHARS} characters each, "
                             f"got one of {len(word)}")
    return list(value)


def tokenize_bad_words(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences ``bad_words`` forbid (vLLM's rule): each word as it is (its
    leading spaces dropped), and after one space where that gives a different first token
    and as many tokens, the form the word takes after another one."""
    sequences: list[list[int]] = []
    for word in words:
        bare = encode(word.lstrip())
        sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return [ids for ids in sequences if ids]


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object, low: float | None, high: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):  # NaN, inf (JSON's 1e309 parses to inf)
        raise ValueError(f"{name} must be a finite number, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
