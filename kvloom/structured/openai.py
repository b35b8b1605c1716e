"""OpenAI-style request fields -> ``StructuredOutput``, for the HTTP server.

Accepted, at most one at a time:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``,
  vLLM's ``{"type": "structural_tag", "structures": [...], "triggers": [...]}`` or
  ``{"type": "structural_tag", "format": {...}}``;
* vLLM's extra fields ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` / ``guided_json_object``;
* vLLM's newer ``structured_outputs`` object with keys ``json`` / ``regex`` /
  ``choice`` / ``grammar`` / ``json_object`` / ``structural_tag`` (its JSON text).

Every problem is a ``ValueError`` whose message names the offending field, ready to
be returned as a 400 ``invalid_request_error``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvloom.structured.constraint import StructuredOutput

# vLLM's `structured_outputs` keys -> StructuredOutput fields.
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                            "choice": "choice", "grammar": "grammar", "structural_tag": "structural_tag"}


def structured_output_from_openai(
    response_format: Mapping[str, Any] | Any | None = None,
    *,
    guided_json: Mapping[str, Any] | str | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    guided_json_object: bool | None = None,
    structured_outputs: Mapping[str, Any] | Any | None = None,
) -> StructuredOutput | None:
    """The constraint the request fields ask for, or None for free text.

    Pydantic models are accepted wherever a mapping is (they are ``model_dump``-ed).
    Raises ValueError naming the field for a malformed field, for more than one
    constraint, or for a constraint whose own value is invalid (e.g. a schema that is
    not a JSON object). Whether a schema/regex/grammar compiles is checked later, by
    ``LLMEngine.add_request``, which raises ValueError too.
    """
    candidates: list[tuple[str, dict[str, Any]]] = []
    from_format = _from_response_format(_as_mapping(response_format, "response_format"))
    if from_format is not None:
        candidates.append(("response_format", from_format))
    guided = {"json_schema": guided_json, "regex": guided_regex, "choice": guided_choice,
              "grammar": guided_grammar, "json_object": guided_json_object or None}
    for field, value in guided.items():
        if value is not None:
            name = "guided_json" if field == "json_schema" else f"guided_{field}"
            candidates.append((name, {field: value}))
    outputs = _as_mapping(structured_outputs, "structured_outputs")
    if outputs is not None:
        for key, value in outputs.items():
            if key not in _STRUCTURED_OUTPUTS_KEYS:
                raise ValueError(f"structured_outputs.{key} is not supported: the keys are "
                                 f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}")
            if value is not None and value is not False:
                candidates.append((f"structured_outputs.{key}", {_STRUCTURED_OUTPUTS_KEYS[key]: value}))
    if not candidates:
        return None
    if len(candidates) > 1:
        names = ", ".join(name for name, _ in candidates)
        raise ValueError(f"only one structured output constraint may be given, got {names}")
    name, fields = candidates[0]
    try:
        return StructuredOutput(**fields)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def _as_mapping(value: Any, name: str) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if hasattr(value, "model_dump"):  # a pydantic model from the server's protocol
        value = value.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    return value


def _from_response_format(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object with a 'schema' field")
        # OpenAI names the field "schema"; pydantic models often alias it as "schema_".
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            raise ValueError("response_format.json_schema.schema is required")
        if schema is False:
            raise ValueError("response_format.json_schema.schema is false: no value satisfies it, "
                             "so there is nothing to generate")
        return {"json_schema": schema}
    if kind == "structural_tag":
        return {"structural_tag": response_format}
    raise ValueError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema', 'structural_tag', got {kind!r}"
    )
