"""The OpenAI-compatible HTTP server: ``kvloom serve`` / ``run_server``.

Modules: ``protocol`` (request schemas), ``async_engine`` (the engine thread),
``app`` (routes), ``serving_completions`` / ``serving_chat`` (the two generation
endpoints), ``generation`` (what they share up to the engine), ``responses`` (the
response envelope and the one SSE loop), ``errors``, ``middleware``, ``metrics``.
Nothing here is imported by ``import kvloom``: FastAPI loads only when serving.
"""
