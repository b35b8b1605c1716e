"""OpenAI request schemas (pydantic), strict on purpose.

Every model forbids unknown fields and validates types strictly (``"5"`` is not an
integer): a field we do not implement (``best_of``, ``suffix``, ``audio``...) is a 400
naming it, never a silent no-op. Fields that change nothing here (``user``,
``metadata``, ``store: false``, ``service_tier``) are accepted, and a ``null`` stands
for "not given" on every optional field, as clients send them. Value
ranges are left to ``SamplingParams`` so that the offline API and the server report the
same message for the same mistake. Responses are plain dicts built in ``serving_*.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvloom.generation_config import json_object

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
    # vLLM's: with include_usage, every chunk carries the usage so far (else null).
    continuous_usage_stats: bool = False


class RequestModel(StrictModel):
    """A request body: ``null`` for a field with a non-null default means the default
    (clients such as LangChain and the Agents SDK send ``"n": null``, ``"stream": null``)."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaults = {name: field.default for name, field in cls.model_fields.items()
                    if not field.is_required()}
        return {key: value for key, value in data.items()
                if not (value is None and key in defaults and defaults[key] is not None)}


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions.

    OpenAI's names and meanings; ``top_k``, ``min_p``, ``repetition_penalty``,
    ``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``priority``, ``allowed_token_ids``,
    ``bad_words``, ``skip_special_tokens``, ``include_stop_str_in_output``,
    ``truncate_prompt_tokens``, ``return_tokens_as_token_ids``, ``cache_salt`` and
    ``request_id`` are vLLM's extensions (sent by the OpenAI SDK through ``extra_body``).
    """

    model: str | None = None
    # vLLM's: the response's id is "<kind>-<request_id>" (the engine's requests get a
    # suffix of their own, so that two clients' equal ids never clash).
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
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
    # {token id (a JSON string key): bias in [-100, 100]}, checked by SamplingParams.
    logit_bias: dict[str, Any] | None = None
    # vLLM's: the only token ids that may be sampled; words the output may not contain.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's detokenization switches: drop special tokens from the text; keep the stop
    # string that ended the output in its text.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = None
    # vLLM's: logprobs name each token "token_id:<id>" instead of its text (a token that
    # is part of a UTF-8 character has no text of its own).
    return_tokens_as_token_ids: bool = False
    # vLLM's (0.10.2 on): the prompt's and each choice's token ids in the response (RL
    # frameworks train on exactly the tokens sampled); streamed, each chunk's new ids.
    return_token_ids: bool = False
    # vLLM's: prefix-cache hits only among requests that send the same salt (a tenant's),
    # so that one cannot time another's prompts through the cache.
    cache_salt: str | None = None
    # vLLM's beam search (server/beam_search.py): n beams, ranked by their summed
    # log-probability over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # An end-user identifier for abuse monitoring at OpenAI; it changes nothing here.
    user: str | None = None
    # Bookkeeping for OpenAI's dashboard: accepted, no effect on generation.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # Whether OpenAI stores the completion for later retrieval: nothing is stored here,
    # so only false/null is honest (true is refused by generation.base_params).
    store: bool | None = None
    # vLLM's prompt logprobs (0-20 alternatives per prompt token; not with stream).
    prompt_logprobs: int | None = None
    # kvloom's: prompt logprobs only from this prompt token on; the prefix before it may
    # be served by the prefix cache (those positions are null). 0 or absent: all of them.
    prompt_logprobs_start: int | None = None
    # Prefill/decode disaggregation, set by kvloom's router (as vLLM's field of that name):
    # {"do_remote_decode": true} asks a --role prefill instance to compute and stage the
    # prompts' KV; {"transfers": [...]} (what that instance answered) tells a --role
    # decode instance where each prompt's KV is staged. Read by generation.py.
    kv_transfer_params: dict[str, Any] | None = None
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

    @property
    def continuous_usage_in_stream(self) -> bool:
        return self.include_usage_in_stream and self.stream_options is not None and \
            self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """POST /v1/completions (OpenAI's legacy completions)."""

    prompt: PromptInput = Field(description=(
        "Text, a list of texts, a list of token ids, or a list of token-id lists; never empty "
        "(no empty list, and the prompt must tokenize to at least one token)."),
        json_schema_extra={"minLength": 1, "minItems": 1})
    echo: bool = False
    # The legacy format: an integer number of alternatives per position.
    logprobs: int | None = None
    add_special_tokens: bool = Field(default=True, description=(
        "Whether a text prompt is tokenized with the tokenizer's special tokens (a BOS), as "
        "vLLM's field; token-id prompts are taken as they are."))

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
    """One message, in the shapes OpenAI's clients send: ``developer`` (read as system),
    assistant turns with ``tool_calls`` (``content`` may then be null) and ``tool``
    results answering a ``tool_call_id``. ``refusal`` and ``annotations`` are what the
    SDK echoes back from an earlier assistant message; they are not rendered. An
    assistant message's ``reasoning`` (vLLM's name; ``reasoning_content``, SGLang's and
    vLLM's older one, is read the same) reaches the template as ``reasoning_content``,
    the name thinking models' templates read, and as ``thinking``, GPT-OSS's."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
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

    @field_validator("tool_calls")
    @classmethod
    def _parse_tool_calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Each call checked and kept as the chat template takes it (``to_template``):
        type "function", arguments a parsed JSON object ("" and absent: {})."""
        if value is None:
            return None
        calls = []
        for index, call in enumerate(value):
            function = call.get("function")
            if (call.get("type", "function") != "function" or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str)
                    or not isinstance(function.get("arguments", ""), str | dict)):
                raise ValueError("each tool call must be {\"id\": ..., \"type\": \"function\", "
                                 "\"function\": {\"name\": <string>, \"arguments\": <JSON string>}}")
            arguments = json_object(function.get("arguments") or "{}", f"call {index}'s function.arguments")
            calls.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
        return calls

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only for an assistant "
                             "message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed on tool messages, not {self.role}")
        if (self.reasoning is not None or self.reasoning_content is not None) and self.role != "assistant":
            raise ValueError(f"reasoning is only allowed on assistant messages, not {self.role}")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ; give one of them")
        return self

    def text(self) -> str | None:
        """The content as one string (text parts concatenated, as OpenAI reads them)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as transformers' ``apply_chat_template`` receives it: developer
        becomes system, and tool-call arguments are parsed JSON objects (as transformers'
        tool-use docs and vLLM hand them to templates, which ``tojson`` them). A null
        content (an assistant turn of tool calls only) is "": templates that know tool
        calls test it for truth, and those that do not concatenate it."""
        text = self.text()
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": "" if text is None else text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # under both names templates read: thinking models' and GPT-OSS's
            message["reasoning_content"] = message["thinking"] = reasoning
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(description="The conversation; at least one message.",
                                        json_schema_extra={"minItems": 1})
    # OpenAI's newer name for max_tokens; both given and different is a 400.
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI's function tools: rendered into the chat template, called per tool_choice (server/tool_calling.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template controls: extra variables for the template, whether to open an
    # assistant turn, or to continue the final (assistant) message instead.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: with --reasoning-parser, whether the response carries the reasoning (else
    # only the content after it).
    include_reasoning: bool = True
    # vLLM's: with --reasoning-parser, at most this many tokens of reasoning: where they run
    # out, the reasoning's end marker is the next token (sampling_params.ThinkingBudget).
    thinking_token_budget: int | None = Field(default=None, ge=0)
    # vLLM's template inputs: RAG documents (the template's `documents`), the effort a
    # reasoning model's template may read (`reasoning_effort`), and a whole template for
    # this request (only with --trust-request-chat-template).
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    chat_template: str | None = None
    # vLLM's: special tokens (a BOS) added on top of what the template writes; and echo,
    # the last message's content before the answer where it is the assistant's (with
    # continue_final_message: the whole message, continued).
    add_special_tokens: bool = False
    echo: bool = False

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must contain at least one message")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(RequestModel):
    """POST /tokenize: ``{"prompt": ...}`` or ``{"messages": [...]}`` (vLLM's shape). A
    chat is encoded as /v1/chat/completions encodes it, with the same template fields, so
    its count is the prompt tokens a chat request with them would have."""

    model: str | None = None
    prompt: str | None = None
    # The tokenizer's special tokens: on a prompt by default, on a chat (whose template
    # writes its own) not, as vLLM's.
    add_special_tokens: bool | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: each token's string too ("token_strs").
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _exactly_one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must contain at least one message")
        return self


class LoadLoRAAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter (vLLM's): a PEFT adapter directory under a new name."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter (vLLM's; ``lora_int_id`` is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(RequestModel):
    """POST /detokenize: ``{"tokens": [...]}`` -> ``{"prompt": ...}``."""

    model: str | None = None
    tokens: list[int]


class ResponsesRequest(RequestModel):
    """POST /v1/responses (OpenAI's Responses API; server/serving_responses.py reads it as
    the chat request it amounts to). ``store``, ``previous_response_id`` and ``background``
    need a server that stores responses (--enable-responses-store). ``input``
    items are checked item by item there, so that an error names ``input[i]``."""

    model: str | None = None
    input: str | list[Any] = Field(description="Text, or a list of input items (messages, function calls "
                                                "and their outputs); never empty.")
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    # Function tools in the Responses shape ({"type": "function", "name", "parameters", ...}).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}}: structured output.
    text: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    # Accepted, no effect here: bookkeeping, and a cache hint (the radix cache matches
    # prefixes whatever the key).
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # Prefill/decode disaggregation, set by kvloom's router (as chat's field of that name).
    kv_transfer_params: dict[str, Any] | None = None
