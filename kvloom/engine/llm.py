"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from kvloom.config import DEFAULT_MODEL, EngineConfig
from kvloom.engine.beam_search import BeamSearch, BeamSearchParams, BeamSequence, advance_round
from kvloom.engine.classification import class_probabilities, cross_encoder_check
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvloom.engine.similarity import cosine_scores, pair_up
from kvloom.lora.request import LoRARequest
from kvloom.sampling_params import RequestOutputKind, SamplingParams, fan_out
from kvloom.tokenizer import Tokenizer, resolve_chat_template

Prompt = str | list[int]
# vLLM's prompt dicts: TextPrompt {"prompt": str} and TokensPrompt {"prompt_token_ids": [int]}.
PromptDict = dict[str, Any]
Message = dict[str, Any]  # role, content, and tool_calls / tool_call_id / name as transformers takes them


class LLM:
    """Offline batch generation. Keyword arguments are the engine options
    (``kvloom.config.ENGINE_OPTIONS``: the fields of EngineConfig and of its cache and
    scheduler sections, e.g. ``num_blocks``, ``block_size``, ``kv_cache_memory``,
    ``max_num_seqs``, ``dtype``, ``scheduling``), named as the CLI flags."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Release the engine's other processes (``tensor_parallel_size > 1``: stop its
        ranks); nothing to do for a single-process engine. Generates no more after."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string or a list of token ids (or vLLM's ``{"prompt": text}`` /
        ``{"prompt_token_ids": ids}``). ``n > 1`` runs n independent
        samples of the prompt (seed, when given, becomes seed + i for sample i). Only
        the finished outputs are returned, so every request runs as ``FINAL_ONLY``
        (vLLM's LLM does the same): no output is built per step, and the text is
        detokenized once at the end unless a stop string needs it sooner. ``cache_salt``
        (vLLM's, for every prompt of the call): prefix-cache hits only among requests
        with the same salt. ``lora_request`` (vLLM's): the LoRA adapter for every prompt,
        or one per prompt (None: the base model); the engine needs ``enable_lora``.
        """
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, Sequence)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")

        # One engine request per sample; `owners` maps it back to (prompt index, sample index).
        # An id is owned before its request is added, and whatever ends this call early
        # (a refused request, an engine fault, Ctrl-C) aborts every owned request that has
        # not finished: none is left running in the engine to hold blocks or to fail the
        # next call again.
        owners: dict[str, tuple[int, int]] = {}
        finals: dict[str, RequestOutput] = {}
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                for sample, sample_params in enumerate(fan_out(final_only)):
                    request_id = self.engine.new_request_id()
                    owners[request_id] = (index, sample)
                    self.engine.add_request(prompt, sample_params, request_id=request_id,
                                            priority=priorities[index], cache_salt=cache_salt,
                                            lora_request=loras[index])
            self._run(owners, finals, use_tqdm if use_tqdm is not None else len(owners) > 8)
        except BaseException:
            for request_id in owners.keys() - finals.keys():
                self.engine.abort_request(request_id)
            raise
        return self._merge(prompts, params_list, owners, finals)

    def _run(self, owners: dict[str, tuple[int, int]], finals: dict[str, RequestOutput], show: bool) -> None:
        """Step until every owned request has finished (into ``finals``). The bar counts
        finished requests and shows the output tokens as they come (vLLM's 'Processed
        prompts' bar)."""
        num_output_tokens = 0
        with tqdm(total=len(owners), desc="generating", unit="req", disable=not show) as bar:
            while len(finals) < len(owners):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine stopped with requests unfinished")
                for output in self.engine.step():
                    if output.request_id not in owners:
                        continue
                    num_output_tokens += len(output.outputs[0].delta_token_ids)
                    if output.finished:
                        finals[output.request_id] = output
                        bar.update(1)
                if show:
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(f"output {num_output_tokens} tok, {num_output_tokens / elapsed:.1f} tok/s",
                                        refresh=True)

    @staticmethod
    def _merge(prompts: list[Prompt], params_list: list[SamplingParams],
               owners: dict[str, tuple[int, int]], finals: dict[str, RequestOutput]
               ) -> list[RequestOutput]:
        """One output per prompt (the first sample's, in request order) holding its n samples."""
        firsts: dict[int, RequestOutput] = {}
        samples: list[dict[int, CompletionOutput]] = [{} for _ in prompts]
        for request_id, (index, sample) in owners.items():
            output = finals[request_id]
            samples[index][sample] = dataclasses.replace(output.outputs[0], index=sample)
            firsts.setdefault(index, output)
        return [dataclasses.replace(firsts[index], outputs=[samples[index][s] for s in range(params.n)])
                for index, params in enumerate(params_list)]

    def beam_search(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict], params: BeamSearchParams,
                    use_tqdm: bool = False, cache_salt: str | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (engine/beam_search.py): for each prompt the
        ``beam_width`` best beams, best first. Every prompt's live beams go to the engine
        together, one round (one token a beam) per ``generate`` call."""
        params.check_max_logprobs(self.engine.limits.max_logprobs)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in _as_prompt_list(prompts)]
        for index, token_ids in enumerate(token_lists):
            if len(token_ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"prompt {index}'s {len(token_ids)} tokens and max_tokens {params.max_tokens} "
                                 f"exceed the model's context of {self.engine.max_model_len} tokens")
        searches = [BeamSearch(token_ids, params, self.engine.eos_token_ids) for token_ids in token_lists]
        round_params = params.round_params()
        with tqdm(total=params.max_tokens, desc="beam search", unit="token", disable=not use_tqdm) as bar:
            while active := [search for search in searches if not search.done]:
                advance_round(active, self.generate([p for search in active for p in search.prompts()],
                                                    round_params, use_tqdm=False, cache_salt=cache_salt))
                bar.update(1)
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.output_token_ids, skip_special_tokens=True)
            results.append(BeamSearchOutput(search.prompt_token_ids, best))
        return results

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, cache_salt: str | None = None,
             lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied;
        ``tools`` and ``chat_template_kwargs`` go to the template, as in vLLM's LLM.chat;
        ``cache_salt`` and ``lora_request`` as ``generate``'s)."""
        conversations: list[list[Message]] = (
            [messages] if messages and isinstance(messages[0], dict)
            else cast(list[list[Message]], messages))
        prompts: list[Prompt] = [
            self.encode_chat(conversation, add_generation_prompt, continue_final_message=continue_final_message,
                             tools=tools, **(chat_template_kwargs or {}))
            for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt,
                             lora_request=lora_request)

    def embed(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict], use_tqdm: bool | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed`` for a decoder model: each prompt's embedding, the final
        hidden state of its last token, L2-normalized (last-token pooling, as vLLM pools
        decoder models; e5-mistral and gte-Qwen2 are such embedding models). Prompts as
        ``generate``'s; batched, cached and exact as generation is.
        ``truncate_prompt_tokens``: each prompt's last k tokens only (-1: the context's)."""
        return [EmbeddingRequestOutput(output.request_id, output.prompt_token_ids,
                                       EmbeddingOutput(cast(list[float], output.pooled or [])), output.finished,
                                       output.num_cached_tokens)
                for output in self._pooled(prompts, "embed", use_tqdm, lora_request, truncate_prompt_tokens)]

    def classify(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict], use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify`` for a sequence-classification model: each prompt's class
        probabilities, its score head at its last token through the model's activation
        (engine/classification.py). Prompts and ``truncate_prompt_tokens`` as ``embed``'s."""
        classifier = self.engine.model_config.classifier
        if classifier is None:
            raise ValueError("classify needs a sequence-classification model (a *ForSequenceClassification "
                             "checkpoint); this model is a causal LM")
        return [ClassificationRequestOutput(output.request_id, output.prompt_token_ids,
                                            ClassificationOutput(class_probabilities(
                                                cast(list[float], output.pooled or []), classifier)),
                                            output.finished, output.num_cached_tokens)
                for output in self._pooled(prompts, "classify", use_tqdm, lora_request, truncate_prompt_tokens)]

    def encode(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict], pooling_task: str | None = None,
               use_tqdm: bool | None = None, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               truncate_prompt_tokens: int | None = None, use_activation: bool = True) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled output for ``pooling_task``, as a
        float32 tensor in ``outputs.data``: "token_embed" every prompt token's final hidden
        state, L2-normalized ([tokens, hidden]); "token_classify" a classifier's class
        probabilities at every token ([tokens, classes]; ``use_activation`` False: its
        logits); "embed" and "classify" as ``embed`` and ``classify`` ([width]). The
        default is the model's: "token_classify" for a token classifier, else
        "token_embed". A token task computes its whole prompt (no prefix-cache hit)."""
        classifier = self.engine.model_config.classifier
        if pooling_task is None:
            pooling_task = "token_classify" if classifier is not None and classifier.per_token else "token_embed"
        outputs = self._pooled(prompts, pooling_task, use_tqdm, lora_request, truncate_prompt_tokens)
        answers = []
        for output in outputs:
            data = torch.tensor(output.pooled or [], dtype=torch.float32)
            if pooling_task in ("classify", "token_classify") and use_activation:
                assert classifier is not None  # the engine refused the task otherwise
                data = torch.tensor(class_probabilities(data, classifier))  # each row's (token's) own
            answers.append(PoolingRequestOutput(output.request_id, output.prompt_token_ids, PoolingOutput(data),
                                                output.finished, output.num_cached_tokens))
        return answers

    def _pooled(self, prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict], task: str,
                use_tqdm: bool | None, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                truncate_prompt_tokens: int | None) -> list[RequestOutput]:
        """Each prompt as a pooling request of ``task`` (``SamplingParams.pooling``): one
        position computed past the prompt, its pooled vector in ``RequestOutput.pooled``."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=task)
        if truncate_prompt_tokens is not None:
            prompts = [self._truncated(prompt, truncate_prompt_tokens) for prompt in _as_prompt_list(prompts)]
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _truncated(self, prompt: Prompt, keep: int) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (the
        engine's ``AdmissionLimits.truncate``, whose RequestRejected is a ValueError)."""
        return self.engine.limits.truncate(self._ids(prompt), keep)

    def score(self, data_1: Prompt | PromptDict | Sequence[Prompt | PromptDict],
              data_2: Prompt | PromptDict | Sequence[Prompt | PromptDict], /, *, use_tqdm: bool | None = None,
              lora_request: LoRARequest | None = None, truncate_prompt_tokens: int | None = None,
              chat_template: str | None = None,
              chat_template_kwargs: dict[str, Any] | None = None) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: for an embedding model (a bi-encoder) each pair's cosine
        similarity of the two texts' embeddings (``embed``'s); for a cross-encoder (a
        sequence classifier of one label) the sigmoid of its logit for the pair read as
        one input: through a score template where one is given (``chat_template``, a file
        or inline Jinja, else the engine's ``chat_template``; ``chat_template_kwargs`` its
        variables, e.g. ``instruction``: ``Tokenizer.encode_score_pair``), else by the
        tokenizer's pair template (``Tokenizer.encode_pair``). The texts pair 1:1, 1:N or
        N:N (engine/similarity.py); one answer per pair, in ``data_2``'s order."""
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = pair_up(len(first), len(second))
        classifier = self.engine.model_config.classifier
        cross_encoder_check(classifier)
        if chat_template is not None:
            chat_template = resolve_chat_template(chat_template)
        elif self.engine.config.chat_template is not None:
            chat_template = self.tokenizer.chat_template
        if chat_template_kwargs and (classifier is None or chat_template is None):
            raise ValueError("chat_template_kwargs are a score template's variables: give a cross-encoder a "
                             "chat_template to read them")
        if classifier is not None:
            return self._cross_encoder_scores(first, second, pairs, use_tqdm, lora_request, truncate_prompt_tokens,
                                              chat_template, chat_template_kwargs or {})
        embedded = self.embed([*first, *second], use_tqdm=use_tqdm, lora_request=lora_request,
                              truncate_prompt_tokens=truncate_prompt_tokens)
        queries, documents = embedded[:len(first)], embedded[len(first):]
        scores = cosine_scores([q.outputs.embedding for q in queries], [d.outputs.embedding for d in documents],
                               pairs)
        return [ScoringRequestOutput(f"{queries[i].request_id}_{documents[j].request_id}",
                                     queries[i].prompt_token_ids + documents[j].prompt_token_ids, ScoringOutput(score))
                for (i, j), score in zip(pairs, scores, strict=True)]

    def _cross_encoder_scores(self, first: list[Prompt], second: list[Prompt], pairs: list[tuple[int, int]],
                              use_tqdm: bool | None, lora_request: LoRARequest | None,
                              truncate_prompt_tokens: int | None, template: str | None,
                              variables: dict[str, Any]) -> list[ScoringRequestOutput]:
        """``score`` for a cross-encoder: each pair one input (its two texts through the
        score template, or by the tokenizer's pair template; token-id prompts one after
        the other), classified."""
        inputs: list[Prompt] = []
        for i, j in pairs:
            query, document = first[i], second[j]
            if not (isinstance(query, str) and isinstance(document, str)):
                inputs.append(self._ids(query) + self._ids(document))
            elif template is not None:
                inputs.append(self.tokenizer.encode_score_pair(query, document, template, **variables))
            else:
                inputs.append(self.tokenizer.encode_pair(query, document))
        classified = self.classify(inputs, use_tqdm=use_tqdm, lora_request=lora_request,
                                   truncate_prompt_tokens=truncate_prompt_tokens)
        return [ScoringRequestOutput(output.request_id, output.prompt_token_ids, ScoringOutput(output.outputs.probs[0]))
                for output in classified]

    def _ids(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: empty the prefix cache (nothing runs between two calls of this API, so
        no request holds a cached block); returns whether it is empty."""
        return self.engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: the torch profiler records what the engine computes from now on
        (engine/profiler.py)."""
        self.engine.start_profile()

    def stop_profile(self, directory: str | Path) -> Path:
        """End the profile: its Chrome trace (gzipped, for Perfetto or chrome://tracing)
        is written into ``directory``; returns the file's path."""
        return self.engine.stop_profile(directory)

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` uses without sampling params, as vLLM's: the model's
        generation-config defaults (``generation_config``; none: ``SamplingParams()``)."""
        return SamplingParams(**self.engine.generation_defaults)

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    def encode_chat(self, conversation: list[Message], add_generation_prompt: bool = True,
                    **template_options: Any) -> list[int]:
        """The prompt's token ids (``Tokenizer.encode_chat``, as the server encodes chat)."""
        return self.tokenizer.encode_chat(conversation, add_generation_prompt, **template_options)


@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearchOutput:
    """One prompt's beam search: its ``beam_width`` best beams, best first (each beam's
    ``token_ids`` are what it generated; vLLM's ``tokens`` hold the prompt too; ``text``
    leaves out a final EOS)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


def _as_prompt_list(prompts: Prompt | PromptDict | Sequence[Prompt | PromptDict]) -> list[Prompt]:
    """One prompt (a string, a list of token ids, or vLLM's prompt dict) or a sequence of
    them -> a list of strings and token-id lists."""
    if isinstance(prompts, (str, dict)):
        return [_plain(prompts, 0)]
    if prompts and isinstance(prompts[0], int):
        return [cast(list[int], list(prompts))]
    return [_plain(cast(Prompt | PromptDict, prompt), index) for index, prompt in enumerate(prompts)]


def _plain(prompt: Prompt | PromptDict, index: int) -> Prompt:
    """vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` as the text or the ids;
    a dict with any other key (multimodal data, an encoder prompt) is refused, named."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return cast(list[int], prompt["prompt_token_ids"])
    raise ValueError(f"prompt {index} must be a string, a list of token ids, {{\"prompt\": str}} or "
                     f"{{\"prompt_token_ids\": [int]}}; got a dict with keys {sorted(prompt)}")
