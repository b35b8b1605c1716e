"""Shared pieces of the structured-output tests: engines, prompts, schemas, runners."""

from __future__ import annotations

import functools
import json
from typing import Any

from helpers_models import default_model_path

from kvloom import LLM, SamplingParams
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.engine.output import RequestOutput


@functools.lru_cache(maxsize=1)
def default_llm() -> LLM:
    """The default model, shared by the tests of this directory; every test drains it."""
    return LLM(str(default_model_path()), num_blocks=512, block_size=16)


def default_engine() -> LLMEngine:
    return default_llm().engine


def make_default_engine(**kwargs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(str(default_model_path()), **kwargs))


def chat_prompt(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine: LLMEngine, requests: dict[str, tuple[list[int] | str, SamplingParams]],
        on_output=None) -> dict[str, RequestOutput]:
    """Add all requests, step to completion (checking integrity each step); finals by id."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=request_id)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if on_output is not None:
                on_output(output)
            if output.finished:
                finals[output.request_id] = output
        engine.check_integrity()
    assert engine.runner.structured.num_active == 0  # every matcher released
    return finals


def steps_taken(engine: LLMEngine, requests: dict[str, tuple[list[int] | str, SamplingParams]]
                ) -> tuple[int, dict[str, RequestOutput]]:
    before = engine.scheduler.step_count
    finals = run(engine, requests)
    return engine.scheduler.step_count - before, finals


SMALL = {  # bounded, so even a random-weight model finishes it
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"type": "string", "maxLength": 6},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
    },
    "required": ["name", "age", "email"],
    "additionalProperties": False,
}

ORDER = {  # nested objects and an array of objects
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 24},
                                   "city": {"type": "string", "maxLength": 16}},
                    "required": ["street", "city"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "customer", "items"],
    "additionalProperties": False,
}

TICKET = {  # enums
    "type": "object",
    "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "priority": {"type": "integer", "enum": [1, 2, 3]},
        "category": {"type": "string", "enum": ["bug", "feature", "question"]},
        "urgent": {"type": "boolean"},
    },
    "required": ["status", "priority", "category", "urgent"],
    "additionalProperties": False,
}

WEATHER = {  # numbers with bounds
    "type": "object",
    "properties": {
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 300},
        "forecast": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 60},
                     "minItems": 2, "maxItems": 4},
    },
    "required": ["temperature_c", "humidity", "wind_kmh", "forecast"],
    "additionalProperties": False,
}

BOOK = {  # arrays of strings, optional fields
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 30},
        "authors": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "minItems": 1, "maxItems": 3},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2025},
        "isbn": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{10}$"},
    },
    "required": ["title", "authors", "year"],
    "additionalProperties": False,
}

SCHEMAS = {
    "person": (PERSON, "a fictional person with name, age and email"),
    "order": (ORDER, "a shop order with a customer, their address and the ordered items"),
    "ticket": (TICKET, "a support ticket with status, priority, category and urgency"),
    "weather": (WEATHER, "today's weather report with temperature, humidity, wind and forecast"),
    "book": (BOOK, "a book with title, authors, year and ISBN"),
}


def json_prompt(engine: LLMEngine, description: str, schema: dict[str, Any] | None = None) -> list[int]:
    """A chat prompt asking for JSON; with ``schema``, the schema is quoted in it."""
    text = f"Reply with only a JSON object describing {description}."
    if schema is not None:
        text += f" Use this JSON schema: {json.dumps(schema)}"
    return chat_prompt(engine, text)
