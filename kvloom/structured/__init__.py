"""Structured generation: JSON schema, regex, grammar and choice constraints.

Public API (pure Python, importable without llguidance):

* ``StructuredOutput``: the constraint a ``SamplingParams(structured=...)`` carries;
* ``StructuredOutputsParams``: vLLM's spelling of it (``SamplingParams(structured_outputs=...)``);
* ``structured_output_from_openai``: OpenAI / vLLM request fields -> ``StructuredOutput``.

The machinery (grammar compiler, per-request matchers, batched token masks) lives in
``compiler``, ``matcher`` and ``manager`` and is used by the model runner.
"""

from __future__ import annotations

from kvloom.structured.constraint import CONSTRAINT_KINDS, StructuredOutput, StructuredOutputsParams
from kvloom.structured.openai import structured_output_from_openai

__all__ = ["CONSTRAINT_KINDS", "StructuredOutput", "StructuredOutputsParams", "structured_output_from_openai"]
