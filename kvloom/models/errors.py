"""The loaders' one error type (its own module: every loader raises it, none imports another)."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one user-facing line."""
