"""OpenAI request schemas (pydantic), strict on purpose.

Every model forbids unknown fields and validates types strictly (``"5"`` is not an
integer): a field we do not implement (``tools``, ``logit_bias``, ``best_of``,
``suffix``, ...) is a 400 naming it, never a silent no-op. Value
ranges are left to ``SamplingParams`` so that the offline API and the server report the
same message for the same mistake. Responses are plain dicts built in ``serving_*.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A prompt: text, a batch of texts, token ids, or a batch of token-id lists.
PromptInput = str | list[str] | list[int] | list[list[int]]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        # JSON's "\ud800" parses to a Python string that no UTF-8 encoder (the
        # tokenizer's included) accepts: refuse it here, naming where it is.
        path = _lone_surrogate_at(data, "")
        if path is not None:
            raise ValueError(f"{path or 'the body'} contains a lone UTF-16 surrogate (an invalid character)")
        return data


def _lone_surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string under ``value`` that is not valid Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate_at(key, "") is not None:
            return f"{path} (a field name)" if path else "a field name"
        found = _lone_surrogate_at(item, f"{path}[{key}]" if isinstance(key, int) else
                                   f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    OpenAI's names and meanings; ``top_k``, ``min_p``, ``repetition_penalty``,
    ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` and ``priority`` are vLLM's
    extensions (sent by the OpenAI SDK through ``extra_body``).
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # An end-user identifier for abuse monitoring at OpenAI; it changes nothing here.
    user: str | None = None
    # Structured output: OpenAI's response_format and vLLM's guided_* / structured_outputs
    # (at most one); checked by kvloom.structured.structured_output_from_openai.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    """POST /v1/completions (OpenAI's legacy completions)."""

    prompt: PromptInput = Field(description=(
        "Text, a list of texts, a list of token ids, or a list of token-id lists; never empty "
        "(no empty list, and the prompt must tokenize to at least one token)."),
        json_schema_extra={"minLength": 1, "minItems": 1})
    echo: bool = False
    # The legacy format: an integer number of alternatives per position.
    logprobs: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        # Checked by hand: a union error lists one complaint per branch, which helps no one.
        shape = ("prompt must be a string, a list of strings, a list of token ids, "
                 "or a list of token-id lists")
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(shape)
        if not value:
            raise ValueError("prompt must not be empty")
        if all(isinstance(item, str) for item in value):
            return value
        if all(_is_token_id(item) for item in value):
            return value
        if all(isinstance(item, list) and item and all(_is_token_id(t) for t in item)
               for item in value):
            return value
        raise ValueError(shape)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        for part in value:
            if not isinstance(part, dict):
                raise ValueError("content parts must be objects like {\"type\": \"text\", \"text\": ...}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported; "
                                 "only {\"type\": \"text\"} parts are")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError("a text part must be exactly {\"type\": \"text\", \"text\": <string>}")
        return value

    def text(self) -> str:
        """The content as one string (text parts concatenated, as OpenAI reads them)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def to_template(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(description="The conversation; at least one message.",
                                        json_schema_extra={"minItems": 1})
    # OpenAI's newer name for max_tokens; it wins when both are given.
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(StrictModel):
    """POST /tokenize: ``{"prompt": ...}`` or ``{"messages": [...]}`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must contain at least one message")
        return self


class DetokenizeRequest(StrictModel):
    """POST /detokenize: ``{"tokens": [...]}`` -> ``{"prompt": ...}``."""

    model: str | None = None
    tokens: list[int]
