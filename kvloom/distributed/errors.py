"""Tensor parallel's start-up failure, importable without torch (the CLI catches it)."""


class RankFailed(RuntimeError):
    """A rank could not start (its error, or it disagrees with rank 0)."""
