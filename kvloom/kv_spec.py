"""What a request says about moving its KV between instances (prefill/decode
disaggregation; the transfer itself is kvloom/kv_transfer/).

A **prefill** instance computes a prompt for a request marked ``KVExport`` and stages
the prompt's KV blocks, in its pool's own layout, for a decode instance to pull; the
``StagedKV`` descriptor goes back to whoever asked (the router). A **decode** instance
admits a request marked ``KVImport(staged)`` as it admits a prefix-cache hit: it pulls
the blocks past its own cached prefix into freshly allocated blocks, counts them as
computed and computes only the prompt's last token (its logits are needed), then
decodes. Both sides check the ``KVLayout``: blocks are only ever copied between pools
of the same model, dtype, block size and in-block layout.

Torch-free and importing nothing of kvloom: every layer (request, scheduler, server,
router messages) can hold these.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class KVLayout:
    """Everything two pools must share for a block copied from one to mean the same in
    the other."""

    model: str
    model_fingerprint: str  # a hash of the model's normalised config
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_layout: str  # the attention backend and its in-block order
    num_planes: int = 2  # K and V; 1 for a latent (MLA) pool, whose "head" is the latent

    def blocks_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """``num_blocks`` blocks as the pool holds them: [layers, planes, blocks,
        block_size, kv_heads, head_dim] (staged files and pulls keep this layout)."""
        return (self.num_layers, self.num_planes, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer, every plane."""
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]
        return self.num_layers * self.num_planes * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatch(self, other: KVLayout) -> str | None:
        """None when blocks can move between the two; else the first field that differs,
        as ``"<field> <ours> here, <theirs> there"``."""
        for f in fields(self):
            ours, theirs = getattr(self, f.name), getattr(other, f.name)
            if ours != theirs:
                return f"{f.name} {ours!r} here, {theirs!r} there"
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> KVLayout:
        return cls(**_fields_of(cls, data, "layout"))


@dataclass(frozen=True)
class StagedKV:
    """A prompt's KV, staged by a prefill instance: where to pull it from and what it is.

    ``num_tokens`` tokens in ``num_blocks`` blocks (the last possibly part full) of
    ``layout``; ``token_hash`` is ``token_hash(prompt_token_ids)``, so a decode
    instance that tokenized the request differently refuses the blocks. ``path``: the
    shared-memory file (same host); ``endpoint``: ``host:port`` of the prefill
    instance's torch.distributed server; ``index`` is the transfer's number there.
    ``adapter``: the LoRA adapter's name the KV was computed with (None: the base
    model); a decode instance refuses it for a request on another."""

    key: str
    instance_id: str
    index: int
    num_tokens: int
    num_blocks: int
    token_hash: str
    path: str
    endpoint: str | None
    layout: KVLayout
    adapter: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> StagedKV:
        values = _fields_of(cls, data, "kv_transfer_params transfer")
        values["layout"] = KVLayout.from_dict(values["layout"])
        return cls(**values)


@dataclass(frozen=True)
class KVExport:
    """Prefill side: stage this request's prompt KV once it is computed."""


@dataclass(frozen=True)
class KVImport:
    """Decode side: this request's prompt KV is staged at ``staged``. ``pulls``: how many
    of this instance's requests pull it (the n samples of one prompt); the last one to
    pull tells the prefill side that it may drop it."""

    staged: StagedKV
    pulls: int = 1


KVTransferSpec = KVExport | KVImport


def token_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


_EXPECTED_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "str": str, "str | None": (str, type(None))}


def _fields_of(cls: type, data: Any, what: str) -> dict[str, Any]:
    """``data``'s values for ``cls``'s fields; ValueError naming what is missing or wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be an object, got {type(data).__name__}")
    names = [f.name for f in fields(cls)]
    missing = [name for name in names if name not in data]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}")
    values = {name: data[name] for name in names}
    for f in fields(cls):
        value, kind = values[f.name], f.type
        expected = _EXPECTED_TYPES.get(str(kind))
        if expected is not None and (not isinstance(value, expected) or isinstance(value, bool)):
            raise ValueError(f"{what} field {f.name} must be {kind}, got {value!r}")
    return values
