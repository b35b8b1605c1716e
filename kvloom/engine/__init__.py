"""The engine: scheduler, policies, the step loop and the offline LLM API."""
