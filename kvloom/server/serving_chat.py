"""POST /v1/chat/completions: the model's chat template, streaming and not."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvloom.engine.output import CompletionOutput, TokenLogprobs
from kvloom.sampling_params import SamplingParams, ThinkingBudget
from kvloom.server.async_engine import ModelInfo
from kvloom.server.beam_search import answer, beam_search, check_beam_request
from kvloom.server.errors import bad_request, from_value_error
from kvloom.server.generation import (
    Serving,
    base_params,
    check_n_and_store,
    check_stream_options,
    collect,
    engine_requests,
    open_with_kv_transfer,
    response_ids,
    sampled_entry,
    token_name,
    top_entries,
    truncate_prompt,
)
from kvloom.server.protocol import ChatCompletionRequest, ChatMessage
from kvloom.server.reasoning_parsers import (
    HARMONY_CHANNEL,
    HARMONY_MESSAGE,
    HarmonyStream,
    OutputSplit,
    ReasoningFormat,
    get_reasoning_parser,
    reasoning_stream,
    split_reasoning,
)
from kvloom.server.responses import SSE_HEADERS, GenerationResponse
from kvloom.server.settings import ServerSettings
from kvloom.server.tool_calling import StreamedCalls, ToolUse, message_with_calls, tool_use
from kvloom.server.tool_parsers import ToolParser
from kvloom.structured.tool_grammar import calls_or_output


async def create_chat_completion(body: ChatCompletionRequest, request: Request, serving: Serving):
    info = serving.model_info()
    model = serving.check_model(body.model, info)
    check_stream_options(body)
    _check_max_tokens(body)
    if body.use_beam_search:
        return await _beam_search_chat(body, request, serving, info, model)
    top_logprobs = _top_logprobs(body, info)
    params, tools = params_and_tools(body, serving.settings, top_logprobs, info)
    reasoning = reasoning_of(body, serving.settings, info)
    params = after_reasoning(params, reasoning)
    prompt = truncate_prompt(encode_chat_request(body, info, serving.settings, tools.tools),
                             body.truncate_prompt_tokens, info)
    request_id, engine_id = response_ids("chatcmpl", body)
    stream = await open_with_kv_transfer(serving, request, engine_requests(
        engine_id, [prompt], params, body.effective_max_tokens, info, body.priority,
        "messages", body.cache_salt, serving.lora_for(body.model, info)), body.kv_transfer_params, params.n)
    if isinstance(stream, JSONResponse):  # the prefill leg, answered
        return stream
    response = _Response(request_id, model, int(time.time()), top_logprobs, tools.parser,
                         body.return_tokens_as_token_ids or serving.settings.return_tokens_as_token_ids,
                         body.return_token_ids, reasoning, _echo(body), _role(body, serving.settings))
    if body.stream:
        return StreamingResponse(
            response.stream(stream, request, [len(prompt)], params.n,
                            body.include_usage_in_stream or serving.settings.force_include_usage,
                            body.continuous_usage_in_stream),
            media_type="text/event-stream", headers=SSE_HEADERS)
    finals = await collect(stream, request)
    return JSONResponse(response.full(finals, [len(prompt)], params.n))


def prepared_chat(chat: ChatCompletionRequest, settings: ServerSettings, info: ModelInfo,
                  format_param: str = "response_format") -> tuple[SamplingParams, ToolUse, Reasoning | None, list[int]]:
    """What an API read as a chat request (the Responses and Messages APIs) samples with:
    its parameters (after the reasoning, where a constraint applies), tool use, the
    reasoning split, and the prompt its template renders."""
    params, tools = params_and_tools(chat, settings, None, info, format_param)
    reasoning = reasoning_of(chat, settings, info)
    return after_reasoning(params, reasoning), tools, reasoning, encode_chat_request(chat, info, settings,
                                                                                    tools.tools)


def params_and_tools(body: ChatCompletionRequest, settings: ServerSettings, top_logprobs: int | None,
                     info: ModelInfo, format_param: str = "response_format") -> tuple[SamplingParams, ToolUse]:
    """The request's sampling parameters and tool use: a forced call's grammar becomes
    the output's constraint (with another format as well: a 400; ``format_param`` is
    that field's name in the request, chat's or the Responses API's). Strict tools under
    tool_choice auto hold the calls the model opens; with the request's own format as well,
    the output is calls only or that format's answer (vLLM's rule)."""
    params = base_params(body, settings, top_logprobs, info)
    tools = tool_use(body, settings)
    if tools.parser is not None and tools.parser.special_marker:  # Mistral's [TOOL_CALLS] kept in the text
        params = dataclasses.replace(params, skip_special_tokens=False)
    if tools.constraint is not None and not tools.forced and params.structured is not None:
        # Strict tools (tool_choice auto) and the request's own format: calls or that answer.
        assert tools.tools is not None and tools.parser is not None
        either = calls_or_output(tools.tools, tools.parser.name, settings.tool_strict_level,
                                 body.parallel_tool_calls is not False, params.structured)
        if either is not None:
            tools = dataclasses.replace(tools, constraint=either, forced=True)
            params = dataclasses.replace(params, structured=None)
    # A strict tool's grammar (tool_choice auto) yields to the request's allowed tokens.
    yields = not tools.forced and params.allowed_token_ids is not None
    if tools.constraint is not None and not yields:
        if params.structured is not None:
            raise bad_request(f"{format_param} and a forced tool call (tool_choice) cannot both constrain the "
                              "output", "tool_choice")
        try:
            params = dataclasses.replace(params, structured=tools.constraint)
        except ValueError as error:  # allowed_token_ids with the forced call's grammar
            raise from_value_error(error) from None
    return params, tools


async def _beam_search_chat(body: ChatCompletionRequest, request: Request, serving: Serving, info: ModelInfo,
                            model: str) -> JSONResponse | StreamingResponse:
    """The n best beams as n choices of one assistant message each (text only: tools,
    like every field beam search would not honour, are refused)."""
    check_beam_request(body)
    check_n_and_store(body, serving.settings)
    prompt = truncate_prompt(encode_chat_request(body, info, serving.settings, None), body.truncate_prompt_tokens,
                             info)
    request_id, engine_id = response_ids("chatcmpl", body)
    finals = await beam_search(serving, request, engine_id, [prompt], body, body.effective_max_tokens, info,
                               "messages")
    response = _Response(request_id, model, int(time.time()), None, return_token_ids=body.return_token_ids,
                         reasoning=reasoning_of(body, serving.settings, info), echo=_echo(body),
                         role=_role(body, serving.settings))
    return answer(response, finals, [len(prompt)], body, request, serving.settings)


@dataclasses.dataclass(frozen=True, slots=True)
class Reasoning:
    """How a response splits its outputs (--reasoning-parser): the format, whether the
    output may think (the template's switches), whether the reasoning is sent
    (include_reasoning), and the markers' token ids where each is one token (its
    reasoning tokens are counted up to the end marker's); ``decode`` reads a phrase
    marker's outputs (Granite's), whose tokens are counted by their text."""

    format: ReasoningFormat
    thinking: bool
    included: bool
    end_token_id: int | None
    budget: int | None = None  # thinking_token_budget: the most tokens its reasoning may take
    start_token_id: int | None = None
    decode: Callable[[Sequence[int]], str] | None = None
    # Harmony's: the tokens that open the final channel (<|channel|>final<|message|>), where a
    # constrained answer starts.
    answer_opening: tuple[int, ...] | None = None

    def tokens(self, token_ids: Sequence[int]) -> int:
        """An output's reasoning tokens (usage's reasoning_tokens): those before the end
        marker's (all where it has none) in an output that thinks, else none. An output
        that must open its reasoning itself thinks only where it begins with the start
        marker; with phrase markers, the leading tokens whose text lies within the start
        marker and the reasoning."""
        ids = list(token_ids)
        if not self.thinking or not ids:
            return 0
        if self.format.markers == "text":
            assert self.decode is not None
            return _tokens_within(ids, self.decode, self.format)
        if self.format.markers == "harmony":
            assert self.decode is not None
            return _harmony_reasoning_tokens(ids, self.decode, self.format)
        if not self.format.opened_by_template and ids[0] != self.start_token_id:
            return 0
        return ids.index(self.end_token_id) if self.end_token_id in ids else len(ids)


def _tokens_within(ids: list[int], decode: Callable[[Sequence[int]], str], reasoning: ReasoningFormat) -> int:
    """The most leading tokens whose decoded text is a prefix of the output's opening
    marker and reasoning (found by bisection: a longer prefix of tokens decodes to a
    longer text)."""
    text = decode(ids)
    opening = next((marker for marker in reasoning.starts if text.startswith(marker)), None)
    if opening is None:
        return 0  # an output that did not open its reasoning
    thought, _ = split_reasoning(reasoning, text, True)
    limit = len(opening) + len(thought or "")
    low, high = 0, len(ids)  # decode(ids[:low]) fits; the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if len(decode(ids[:middle])) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def _harmony_reasoning_tokens(ids: list[int], decode: Callable[[Sequence[int]], str],
                               reasoning: ReasoningFormat) -> int:
    """A harmony output's analysis tokens: those its machine reads inside an analysis
    message's body, the ``<|message|>`` that opens it and the marker that ends it."""
    stream, count = HarmonyStream(reasoning, True), 0
    for token_id in ids:
        inside = stream.state == "body" and stream.channel == "analysis"
        stream.feed(decode([token_id]))
        count += inside or (stream.state == "body" and stream.channel == "analysis")
    return count


def reasoning_of(body: ChatCompletionRequest, settings: ServerSettings, info: ModelInfo) -> Reasoning | None:
    """None without a reasoning parser (then a ``thinking_token_budget`` is a 400: nothing
    marks where a reasoning ends). A Qwen3 output whose template was told
    ``enable_thinking: false`` does not think: all of it is content. A budget needs a
    format whose markers are tokens: phrases (Granite's) cannot be forced or counted by
    the token."""
    if settings.reasoning_parser is None:
        if body.thinking_token_budget is not None:
            raise bad_request("thinking_token_budget needs a reasoning model's end marker: start the server with "
                              "--reasoning-parser", "thinking_token_budget")
        return None
    reasoning = get_reasoning_parser(settings.reasoning_parser)
    if body.thinking_token_budget is not None and not can_cap(reasoning):
        raise bad_request(f"thinking_token_budget is not supported with --reasoning-parser {reasoning.name}: its "
                          "reasoning is marked by phrases or channels, not one token, so a budget cannot count it "
                          "or end it", "thinking_token_budget")
    tokenizer = info.tokenizer
    answer_opening = None
    if reasoning.markers == "harmony":  # its markers are the model's tokens (check_vocabulary, at start)
        channel, message = tokenizer.token_to_id(HARMONY_CHANNEL), tokenizer.token_to_id(HARMONY_MESSAGE)
        assert channel is not None and message is not None
        answer_opening = (channel, *tokenizer.encode("final", add_special_tokens=False), message)
    return Reasoning(reasoning, reasoning.thinks(body.chat_template_kwargs or {}), body.include_reasoning,
                     tokenizer.token_to_id(reasoning.end), body.thinking_token_budget,
                     tokenizer.token_to_id(reasoning.start),
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens
                                                  and reasoning.markers != "harmony"), answer_opening)


def can_cap(reasoning: ReasoningFormat) -> bool:
    """Whether a thinking budget can end this format's reasoning: its markers are tokens
    (the end marker to force; where the model opens its reasoning itself, the start
    marker that says it did). The Messages API ignores a budget where not."""
    return reasoning.markers in ("token", "special")


def after_reasoning(params: SamplingParams, reasoning: Reasoning | None) -> SamplingParams:
    """An output that thinks is constrained (response_format, a forced tool call) from
    after its reasoning's end marker, as vLLM's: the reasoning is free, the answer is the
    grammar's (``StructuredOutput.after_token_id``); and its reasoning is capped at the
    request's ``thinking_token_budget`` (``ThinkingBudget``; where the model opens its
    reasoning itself, counted after its start marker). Where the model opens its
    reasoning itself (Mistral's, Granite's), whether it will is not known, so a
    constraint holds from the first token (the output answers without reasoning); special
    markers are decoded into the text (skip_special_tokens false) for the split."""
    if reasoning is not None and reasoning.format.markers in ("special", "harmony"):
        params = dataclasses.replace(params, skip_special_tokens=False)
    if reasoning is not None and reasoning.answer_opening is not None:  # harmony: the final channel's text
        if params.structured is None or not reasoning.thinking:
            return params
        return dataclasses.replace(params, structured=dataclasses.replace(params.structured,
                                                                          after_token_id=reasoning.answer_opening))
    if reasoning is None or not reasoning.thinking or reasoning.end_token_id is None:
        return params
    opened_by_template = reasoning.format.opened_by_template
    if reasoning.budget is not None:
        start = None if opened_by_template else reasoning.start_token_id
        assert opened_by_template or start is not None  # can_cap: the markers are tokens
        params = dataclasses.replace(params, thinking_budget=ThinkingBudget(reasoning.budget, reasoning.end_token_id,
                                                                            start))
    if params.structured is None or not opened_by_template:
        return params
    return dataclasses.replace(params, structured=dataclasses.replace(params.structured,
                                                                      after_token_id=reasoning.end_token_id))


# Template variables that the render sets itself.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                          "continue_final_message"})


class TemplatedChat(Protocol):
    """What a request renders through the chat template with: chat's, /tokenize's and the
    pooling routes' fields of these names."""

    @property
    def messages(self) -> list[ChatMessage] | None: ...
    @property
    def add_generation_prompt(self) -> bool: ...
    @property
    def continue_final_message(self) -> bool: ...
    @property
    def documents(self) -> list[dict[str, str]] | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def chat_template_kwargs(self) -> dict[str, Any] | None: ...
    @property
    def add_special_tokens(self) -> bool | None: ...


def _template_kwargs(body: TemplatedChat) -> dict[str, Any]:
    """The template's extra variables: ``reasoning_effort`` where given (as vLLM passes
    it), then ``chat_template_kwargs``."""
    kwargs = body.chat_template_kwargs or {}
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (they are "
                          "request fields of their own)", "chat_template_kwargs")
    reasoning_effort = getattr(body, "reasoning_effort", None)  # chat's; /tokenize has none
    effort = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
    return {**effort, **kwargs}


def encode_chat_request(body: TemplatedChat, info: ModelInfo, settings: ServerSettings,
                        tools: list[dict[str, Any]] | None) -> list[int]:
    """The request's prompt: its messages through the model's template (or its own,
    where the server trusts requests' templates), with its documents and variables
    (chat's, and /tokenize's for the same count)."""
    assert body.messages is not None
    if body.chat_template is not None and not settings.trust_request_chat_template:
        raise bad_request("chat_template in a request needs the server started with "
                          "--trust-request-chat-template (a template is code the server runs)", "chat_template")
    return encode_messages(body.messages, info, add_generation_prompt=body.add_generation_prompt, tools=tools,
                           template_kwargs=_template_kwargs(body), continue_final_message=body.continue_final_message,
                           documents=body.documents, chat_template=body.chat_template,
                           add_special_tokens=bool(body.add_special_tokens))


def _echo(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text, where it is the assistant's (the role
    the answer is in), goes before the answer; else nothing."""
    last = body.messages[-1]
    return (last.text() or "") if body.echo and last.role == "assistant" else ""


def _check_max_tokens(body: ChatCompletionRequest) -> None:
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt to be false (the "
                          "final message is continued, no new turn is opened)", "continue_final_message")
    if (body.max_tokens is not None and body.max_completion_tokens is not None
            and body.max_tokens != body.max_completion_tokens):
        raise bad_request(f"max_completion_tokens ({body.max_completion_tokens}) and max_tokens "
                          f"({body.max_tokens}) disagree; give one of them", "max_completion_tokens")


def _role(body: ChatCompletionRequest, settings: ServerSettings) -> str:
    """The reply's role, as vLLM names it: --response-role where the prompt opens a new
    turn (add_generation_prompt), else the continued last message's own."""
    return settings.response_role if body.add_generation_prompt else body.messages[-1].role


def _top_logprobs(body: ChatCompletionRequest, info: ModelInfo) -> int | None:
    """The SamplingParams.logprobs value: None when logprobs are off."""
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= body.top_logprobs <= info.limits.max_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {info.limits.max_logprobs}] (the server's "
                              f"--max-logprobs), got {body.top_logprobs}", "top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


def encode_messages(messages: list[ChatMessage], info: ModelInfo, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
                    chat_template: str | None = None, add_special_tokens: bool = False) -> list[int]:
    """The prompt's token ids (``Tokenizer.encode_chat``, as ``LLM.chat`` encodes); a
    template's refusal is a 400 naming the first message it cannot render."""
    conversation = [message.to_template() for message in messages]
    options = dict(tools=tools, continue_final_message=continue_final_message, documents=documents,
                   chat_template=chat_template, **(template_kwargs or {}))
    try:
        return info.tokenizer.encode_chat(conversation, add_generation_prompt, add_special_tokens=add_special_tokens,
                                          **options)
    except ValueError as error:  # no chat template, continue_final_message
        raise bad_request(str(error), "messages") from None
    except (jinja2.TemplateError, TypeError) as error:
        # The template's own raise_exception (role order, ...) or a message it cannot
        # handle (None + str for a tool call's null content).
        index = _first_unrenderable(conversation, info, tools, {**(template_kwargs or {}), "documents": documents,
                                                                "chat_template": chat_template})
        where = "messages" if index is None else f"messages[{index}]"
        raise bad_request(f"the chat template cannot render {where}: {error}", where) from None


def _first_unrenderable(conversation: list[dict[str, Any]], info: ModelInfo,
                        tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]
                        ) -> int | None:
    """The index of the message whose addition makes the template fail, if any."""
    for end in range(1, len(conversation) + 1):
        try:
            info.tokenizer.apply_chat_template(conversation[:end], add_generation_prompt=False,
                                               tools=tools, **template_kwargs)
        except (jinja2.TemplateError, TypeError):
            return end - 1
    return None


class _Response(GenerationResponse):
    """A chat completion: choices hold a ``message``, chunks a ``delta``."""

    kind, full_object, chunk_object = "chat", "chat.completion", "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, created: int, top_logprobs: int | None,
                 tool_parser: ToolParser | None = None, tokens_as_ids: bool = False,
                 return_token_ids: bool = False, reasoning: Reasoning | None = None, echo: str = "",
                 role: str = "assistant") -> None:
        super().__init__(request_id, model, created, return_token_ids)
        self.top_logprobs = top_logprobs
        self.tokens_as_ids = tokens_as_ids  # return_tokens_as_token_ids
        self.tool_parser = tool_parser  # parse the output into tool_calls (None: plain text)
        self._streamed_calls = StreamedCalls(tool_parser) if tool_parser is not None else None
        # --reasoning-parser: the split, and each streamed choice's machine (the reasoning
        # goes first; the tool-call parser reads the content after it).
        self.reasoning = reasoning
        self._reasoning_streams: dict[int, OutputSplit] = {}
        self.echo = echo  # vLLM's echo: the last (assistant) message's text before each answer
        self.role = role  # the reply's role (_role)

    def choice(self, index: int, completion: CompletionOutput) -> dict[str, Any]:
        content: str | None = completion.text
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning is not None:
            thought, content = split_reasoning(self.reasoning.format, completion.text, self.reasoning.thinking)
            message = {"role": self.role, "content": content,
                       "reasoning": thought if self.reasoning.included else None}
        finish_reason = completion.finish_reason
        if self.tool_parser is not None and content is not None:
            calls, finish_reason = message_with_calls(self.tool_parser, content, finish_reason)
            message.update(calls, role=self.role)
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": self._logprobs(completion.logprobs),
                "finish_reason": finish_reason}

    def attach_prompt_logprobs(self, data: dict[str, Any], by_choice: dict[int, list[Any] | None]) -> None:
        data["prompt_logprobs"] = by_choice.get(0)  # one prompt: every choice's is the same

    def completion_details(self, token_ids: list[Sequence[int]]) -> dict[str, Any] | None:
        """With --reasoning-parser, vLLM's ``completion_tokens_details.reasoning_tokens``."""
        if self.reasoning is None:
            return None
        return {"reasoning_tokens": sum(self.reasoning.tokens(ids) for ids in token_ids)}

    def attach_prompt_token_ids(self, data: dict[str, Any], choice: dict[str, Any], token_ids: list[int]) -> None:
        data["prompt_token_ids"] = list(token_ids)  # one prompt: on the response

    def opening_choices(self, num_choices: int) -> list[dict[str, Any]]:
        # The first chunk of every choice names the role.
        return [{"index": index, "delta": {"role": self.role, "content": self.echo}, "logprobs": None,
                 "finish_reason": None} for index in range(num_choices)]

    def delta_logprobs(self, index: int, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        return self._logprobs(entries)

    def delta_choice(self, index: int, text: str, logprobs: dict[str, Any] | None,
                     finish_reason: str | None) -> dict[str, Any] | None:
        thought = ""
        if self.reasoning is not None:
            stream = self._reasoning_streams.get(index)
            if stream is None:
                stream = self._reasoning_streams[index] = reasoning_stream(self.reasoning.format,
                                                                           self.reasoning.thinking)
            thought, text = stream.split(text, finish_reason is not None)
            if not self.reasoning.included:
                thought = ""
        if self._streamed_calls is None:
            delta: dict[str, Any] = {"content": text} if text else {}
        else:
            delta, finish_reason = self._streamed_calls.delta(index, text, finish_reason)
        if thought:
            delta = {"reasoning": thought, **delta}
        if not delta and logprobs is None and finish_reason is None:
            return None  # held back: it may be the start of a marker or a call
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and alternatives."""
        if entries is None or self.top_logprobs is None:
            return None
        content = []
        for entry in entries:
            item = self._token_logprob(*sampled_entry(entry))
            item["top_logprobs"] = [self._token_logprob(token_id, lp)
                                    for token_id, lp in top_entries(entry, self.top_logprobs)]
            content.append(item)
        return {"content": content, "refusal": None}

    def _token_logprob(self, token_id: int, logprob: Any) -> dict[str, Any]:
        token = token_name(token_id, logprob.decoded_token, self.tokens_as_ids)
        return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode("utf-8"))}
