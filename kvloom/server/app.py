"""The FastAPI app: routes, middleware, error handlers and the engine's lifecycle.

``build_app`` wires an ``AsyncEngine`` (which owns the model thread) to HTTP. The app's
lifespan starts the engine thread (the model loads there, while ``/health`` answers
503) and, on shutdown, aborts in-flight requests and joins the thread.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kvloom import __version__
from kvloom.server import dashboard
from kvloom.server.async_engine import AsyncEngine
from kvloom.server.errors import APIError, install_error_handlers
from kvloom.server.generation import Serving, check_token_ids
from kvloom.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestIdHeaderMiddleware,
    ServerLoad,
    ServerLoadMiddleware,
    install_cors,
)
from kvloom.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from kvloom.server.reasoning_parsers import check_vocabulary, get_reasoning_parser
from kvloom.server.serving_chat import create_chat_completion, encode_chat_request
from kvloom.server.serving_classify import ClassificationRequest, create_classification
from kvloom.server.serving_completions import create_completion
from kvloom.server.serving_embeddings import EmbeddingRequest, create_embedding
from kvloom.server.serving_invocations import invoke
from kvloom.server.serving_lora import install_lora_updating
from kvloom.server.serving_messages import CountTokensRequest, MessagesRequest, count_tokens, create_message
from kvloom.server.serving_pooling import PoolingApiRequest, create_pooling
from kvloom.server.serving_profile import install_profiling
from kvloom.server.serving_rerank import RerankRequest, SimilarityScoreRequest, create_rerank, create_similarity_score
from kvloom.server.serving_responses import cancel_response, create_response, retrieve_response, stored_response
from kvloom.server.serving_score import ScoreRequest, chat_roles, create_score
from kvloom.server.settings import ServerSettings


def build_app(async_engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``async_engine``'s model."""
    settings = settings or ServerSettings()
    serving = Serving(async_engine, settings)
    created = int(time.time())
    if settings.reasoning_parser is not None:  # its markers must be the model's tokens
        reasoning = get_reasoning_parser(settings.reasoning_parser)
        async_engine.load_checks.append(lambda engine: check_vocabulary(reasoning, engine.tokenizer))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown()
            for observer in async_engine.observers:  # after the engine thread: nothing observes any more
                close = getattr(observer, "close", None)
                if close is not None:
                    close()

    app = FastAPI(title="kvloom", version=__version__, lifespan=lifespan)
    app.openapi = lambda: openapi_with_openai_errors(app)  # type: ignore[method-assign]
    install_error_handlers(app)
    # Starlette runs the last-added middleware first: the key is checked before the size,
    # and a request refused by either is not counted in the load.
    in_flight = ServerLoad()
    app.add_middleware(ServerLoadMiddleware, load=in_flight)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    if settings.enable_request_id_headers:  # on every answer, a 401 or 413 included
        app.add_middleware(RequestIdHeaderMiddleware)
    install_cors(app, settings.cors)  # last: outermost
    app.state.async_engine = async_engine
    app.state.settings = settings
    if settings.enable_dashboard:
        dashboard.install(app, async_engine)
    if settings.otlp_traces_endpoint is not None:
        from kvloom.server.tracing import RequestTracer  # the OpenTelemetry SDK loads only when asked for
        tracer = RequestTracer(settings.otlp_traces_endpoint, model_name=settings.served_model_name)
        async_engine.observers.append(tracer)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 once the model has loaded; 503 while loading, after a failure, or when
        shutting down."""
        serving.model_info()  # raises the 503
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:
        """SageMaker's health check (vLLM's): ``/health``."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        """vLLM's: the requests on the engine's routes being answered now (always
        tracked here; vLLM's --enable-server-load-tracking is accepted)."""
        return {"server_load": in_flight.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = serving.model_info()
        served = serving.served_name(info)
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": "kvloom", "root": path,
                     "parent": served, "max_model_len": info.max_model_len, "block_size": info.limits.block_size}
                    for name, path in serving.loras.items()]
        return {"object": "list", "data": [{
            "id": served, "object": "model", "created": created,
            "owned_by": "kvloom", "root": info.model_name, "parent": None,
            "max_model_len": info.max_model_len,
            # kvloom's: the KV block size, which `kvloom router` checks workers agree on
            "block_size": info.limits.block_size}, *adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """OpenAI's model retrieval (``client.models.retrieve``): the served model's card
        under any name the server accepts for it, or an adapter's; else a 404."""
        info = serving.model_info()
        cards = (await models())["data"]
        accepted = serving.settings.model_ids(info.model_name)
        for card in cards:
            if card["id"] == model_id or (card["parent"] is None and model_id in accepted):
                return dict(card)
        raise APIError(404, f"The model {model_id!r} does not exist; this server serves "
                            f"{', '.join(repr(card['id']) for card in cards)}", param="model", code="model_not_found")

    @app.get("/kvloom/kv_transfer")
    async def kv_transfer() -> dict[str, Any]:
        """This instance's --role, KV layout and transports: the router's handshake for
        prefill/decode disaggregation (kvloom/kv_spec.py)."""
        return serving.model_info().kv_transfer

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, serving)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        return await create_embedding(body, request, serving)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, serving)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(body, request, serving)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(body, serving)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(body, request, serving)

    @app.get("/v1/responses/{response_id}", response_model=None)
    async def get_response(response_id: str, stream: bool = False,
                           starting_after: int | None = None) -> dict[str, Any] | StreamingResponse:
        return retrieve_response(response_id, serving, stream, starting_after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return stored_response(response_id, serving, delete=True)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_stored(response_id: str) -> dict[str, Any]:
        return await cancel_response(response_id, serving)

    # SageMaker's one route for every task (server/serving_invocations.py).
    @app.post("/invocations", response_model=None)
    async def invocations(request: Request) -> Any:
        return await invoke(request, serving)

    # vLLM's generic Pooling API: any pooling task, per input or per token (server/serving_pooling.py).
    @app.post("/pooling")
    async def pooling(body: PoolingApiRequest, request: Request) -> dict[str, Any]:
        return await create_pooling(body, request, serving)

    # vLLM's Classification API, for a sequence classifier (server/serving_classify.py).
    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassificationRequest, request: Request) -> dict[str, Any]:
        return await create_classification(body, request, serving)

    # vLLM's Score and Rerank APIs: a bi-encoder, or a classifier of one label as a
    # cross-encoder (server/serving_rerank.py).
    @app.post("/score")
    @app.post("/v1/score")
    async def similarity_score(body: SimilarityScoreRequest, request: Request) -> dict[str, Any]:
        return await create_similarity_score(body, request, serving)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        return await create_rerank(body, request, serving)

    @app.post("/kvloom/score")
    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        return await create_score(body, request, serving)

    @app.get("/kvloom/chat_roles")
    async def roles() -> dict[str, list[str]]:
        return chat_roles(serving)

    if settings.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            """vLLM's: the tokenizer's tokenizer_config.json, with the context length as
            ``model_max_length``."""
            info = serving.model_info()
            return {**info.tokenizer.config(), "model_max_length": info.max_model_len}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        info = serving.model_info()
        serving.check_model(body.model, info)
        if body.messages is not None:
            tokens = encode_chat_request(body, info, settings, body.tools)
        else:
            assert body.prompt is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = info.tokenizer.encode(body.prompt, add_special_tokens=special)
        reply: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len}
        if body.return_token_strs:
            reply["token_strs"] = [info.tokenizer.id_to_token(token) or "" for token in tokens]
        return reply

    if settings.allow_runtime_lora_updating:
        install_lora_updating(app, serving)

    if settings.profiler_dir is not None:
        install_profiling(app, serving, settings.profiler_dir)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        """vLLM's: drop the prefix cache's blocks that no request holds (e.g. between
        benchmark runs); ``reset`` is false while requests hold some."""
        serving.model_info()
        return {"reset": await async_engine.call(lambda engine: engine.reset_prefix_cache())}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        info = serving.model_info()
        serving.check_model(body.model, info)
        check_token_ids(body.tokens, info, "tokens")
        return {"prompt": info.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app


def openapi_with_openai_errors(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the errors as this server sends them: a bad body is a 400
    in OpenAI's error shape (install_error_handlers turns validation errors into it),
    never FastAPI's 422."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["OpenAIError"] = OPENAI_ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}}}
    for methods in schema.get("paths", {}).values():
        for operation in methods.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {"description": "Invalid request: the message names the field", **error}
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)
    app.openapi_schema = schema
    return schema


OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
