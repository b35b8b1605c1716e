"""Data parallelism and prefill/decode disaggregation: an OpenAI-compatible router in
front of several kvloom servers.

Modules: ``prefix_tree`` (what the router sent where, as an approximate radix tree over
request text), ``policy`` (the ``RoutingPolicy`` seam: ``cache_aware``, ``round_robin``,
``least_loaded``), ``workers`` (the pool: health, in-flight counts, the startup checks),
``proxy`` (forwarding with retries), ``disagg`` (a request's prefill leg, then its decode
leg, and the fallbacks), ``metrics`` (``/metrics`` summed over workers, plus the
router's own), ``app`` (the routes), ``main`` (``run_router``), ``launch`` (``kvloom
serve --data-parallel-size N`` and ``--role disaggregated``), ``cli`` (``kvloom router``).

Nothing outside ``kvloom/cli.py`` and ``kvloom/server/cli.py`` imports this package, and
it imports from ``kvloom.server`` (errors, middleware, HTTP guards) and below only: a
router never loads a model, torch, or the engine.
"""
