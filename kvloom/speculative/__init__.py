"""Speculative decoding's proposers: cheap guesses at each request's next tokens,
which the engine verifies in one forward pass (engine/speculation.py decides how
many, runner/model_runner.py ``verify_drafts`` decides which are kept)."""
