"""The model side of LoRA: each adapted projection computes ``base(x)`` and adds, to
the rows of each adapter in the step, ``scale * (x A^T) B^T`` for every projection
that adapter targets (a fused projection, q|k|v or gate|up, adds each part's delta
to its own columns). Rows of the base model get nothing added.

The weights of every adapter slot sit in stacked tensors (``max_loras`` slots of rank
``max_lora_rank``; a smaller rank is zero-padded, which adds exact zeros); which rows
run which slot is the step's ``LoRAStep``, shared by every LoRA layer and set by the
runner around each forward. In the model's dtype (as vLLM's), on any device. On a CPU
in bf16 a slot's two matmuls run on the model's own kernel (``matmul``: kvloom's
batch-invariant GEMM by default, packed once per load), so an adapter's rows are as
batch-invariant as the base model's; elsewhere ``F.linear``. On a CPU the delta is added
by ``cpu_ops.add_rows_`` (torch's add, rounded the same), the kernel the native walk
adds it with (kvloom/lora/native.py hands the walk the slots' weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvloom.kernels import cpu_ops
from kvloom.models.packed_linear import packed_linear


@dataclass(slots=True)
class LoRAGroup:
    """The rows of one adapter slot in a forward: ``rows`` (int64 on the device), or,
    where they are one contiguous run (the common case: a request's rows are), that
    run as ``span`` too, which the layers then read and write as views."""

    slot: int
    rows: torch.Tensor
    span: tuple[int, int] | None


@dataclass(slots=True)
class LoRAStep:
    """The forward in progress: for each adapter slot in it, the rows that run it; and
    where the step reads some rows only (``ForwardBatch.output_rows``: the last layer's
    o projection and MLP run on those alone), the same for those rows. ``begin`` only
    notes the step; the groups are worked out when a ``LoRALinear`` first asks (the
    native walk, which takes each row's slot instead, never does)."""

    seq_slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    output_rows: torch.Tensor | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: tuple[list[LoRAGroup], list[LoRAGroup]] | None = None  # (every row's, the read rows')
    _row_slots: dict[int, torch.Tensor | int | None] = field(default_factory=dict)  # row_slots' answers, by rows

    def begin(self, seq_slots: list[int], query_lens: list[int], device: torch.device,
              output_rows: torch.Tensor | None = None) -> None:
        """``seq_slots[i]``: the slot of the batch's sequence i (-1: the base model),
        whose ``query_lens[i]`` rows follow the sequences before it; ``output_rows``: the
        rows the step reads, if not every one."""
        self.seq_slots, self.query_lens, self.device, self.output_rows = seq_slots, query_lens, device, output_rows
        self._groups = None
        self._row_slots = {}

    def groups_for(self, rows: int) -> list[LoRAGroup]:
        """The groups of a projection that runs on ``rows`` rows: every row of the step,
        or (the last layer's o projection and MLP) the rows it reads. None outside a step
        with adapter rows (``begin`` not called: the base model alone)."""
        if not self.seq_slots:
            return []
        if self._groups is None:
            token_slots = [slot for slot, count in zip(self.seq_slots, self.query_lens, strict=True)
                           for _ in range(count)]
            every = _groups(token_slots, self.device)
            read = every if self.output_rows is None else _groups([token_slots[t] for t in self.output_rows.tolist()],
                                                                 self.device)
            self._groups = every, read
        num_tokens = sum(self.query_lens)
        if rows == num_tokens:
            return self._groups[0]
        num_read = num_tokens if self.output_rows is None else self.output_rows.numel()
        assert rows == num_read, f"a LoRA layer ran on {rows} rows; the step has {num_tokens} and reads {num_read}"
        return self._groups[1]

    def row_slots(self, rows: int) -> torch.Tensor | int | None:
        """Each row's slot (int64 on the device, -1: the base model) of a layer that runs
        on ``rows`` rows (every row of the step, or the rows it reads, as ``groups_for``);
        the slot itself where every such row runs one; None where none runs an adapter."""
        if rows not in self._row_slots:
            groups = self.groups_for(rows)
            slots: torch.Tensor | int | None = None
            if len(groups) == 1 and groups[0].span == (0, rows):
                slots = groups[0].slot
            elif groups:
                slots = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
                for group in groups:
                    slots[group.rows] = group.slot
            self._row_slots[rows] = slots
        return self._row_slots[rows]

    def end(self) -> None:
        self.seq_slots, self.query_lens, self.output_rows, self._groups = [], [], None, None
        self._row_slots = {}


def _groups(row_slots: list[int], device: torch.device) -> list[LoRAGroup]:
    """Each slot's rows of ``row_slots`` (each row's slot, -1: the base model)."""
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            rows.setdefault(slot, []).append(row)
    return [LoRAGroup(slot, torch.tensor(r, dtype=torch.int64, device=device),
                      (r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else None)
            for slot, r in rows.items()]


class LoRALinear(nn.Module):
    """A projection (packed or plain) with LoRA deltas for its ``parts``: (name, first
    output column, columns) each, one per unfused projection an adapter may target.

    Per slot, the parts' A matrices are stacked (``a``: [parts * rank, in]) and their B
    matrices, scale folded in, form a block-diagonal ``b`` ([out, parts * rank]), so a
    slot's delta for every part is two matmuls: ``(x a^T) b^T``. A part the adapter
    does not target has zero blocks, which add exact zeros; a slot that targets none of
    the parts is skipped."""

    def __init__(self, base: nn.Module, parts: list[tuple[str, int, int]], in_features: int, max_loras: int,
                 max_rank: int, step: LoRAStep, dtype: torch.dtype, device: torch.device,
                 matmul: str = "invariant") -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.step = step
        self.max_rank = max_rank
        self.matmul = matmul
        out_features = sum(size for _, _, size in parts)
        self.a = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, len(parts) * max_rank, dtype=dtype, device=device)
        self.active = [False] * max_loras  # whether the slot targets any part
        # Each slot's (shrink, expand) kernels once loaded (``finish``): x -> x a^T -> (x a^T) b^T.
        self.kernels: list[tuple[nn.Module, nn.Module] | None] = [None] * max_loras

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part ``part`` of slot ``slot`` becomes ``b a`` (a: [rank, in], b: [out, rank] with the
        module's scale folded in: ``LoRAAdapter.weights``), after ``clear(slot)``, so the rank's
        padding and the off-diagonal blocks are zeros."""
        rank, (_, start, size) = a.shape[0], self.parts[part]
        first = part * self.max_rank
        self.a[slot, first:first + rank].copy_(a)
        self.b[slot, start:start + size, first:first + rank].copy_(b)
        self.active[slot] = True

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.active[slot] = False
        self.kernels[slot] = None

    def finish(self, slot: int) -> None:
        """After a slot's parts are loaded: its two matmuls' kernels (weights packed)."""
        if self.active[slot]:
            self.kernels[slot] = (_kernel(self.a[slot], self.matmul), _kernel(self.b[slot], self.matmul))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        for group in self.step.groups_for(x.shape[0]):
            kernels = self.kernels[group.slot]
            if kernels is None:  # the adapter targets none of this projection's parts
                continue
            shrink, expand = kernels
            if group.span is not None:
                lo, hi = group.span
                _add_rows(y[lo:hi], expand(shrink(x[lo:hi])), None)
            else:
                _add_rows(y, expand(shrink(x[group.rows])), group.rows)
        return y


class LoRAExperts:
    """LoRA deltas on a mixture-of-experts layer's routed experts (models/moe.py's
    ``ExpertAdapters``): per slot, for ``gate_up`` (gate | up rows, one A for both, as
    PEFT's adapter on the fused tensor) and ``down``, each expert's ``scale * B_e (A_e x)``.
    Each (slot, part, expert) pair of matmuls runs on the model's kernel, as
    ``LoRALinear``'s, so an adapter's rows stay batch-invariant; a slot whose adapter
    leaves a part alone adds nothing to it."""

    PARTS = ("gate_up", "down")

    def __init__(self, max_loras: int, step: LoRAStep, dtype: torch.dtype, device: torch.device,
                 matmul: str = "invariant") -> None:
        self.step = step
        self.dtype, self.device = dtype, device
        self.matmul = matmul
        # kernels[slot][part]: each expert's (shrink, expand), or None (not adapted).
        self.kernels: list[list[list[tuple[nn.Module, nn.Module]] | None]] = [[None, None] for _ in range(max_loras)]

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part ``part`` (0: gate_up, 1: down) of slot ``slot`` becomes, for each expert e,
        ``b[e] a[e]`` (a: [experts, rank, in], b: [experts, out, rank], scale folded in as
        ``LoRALinear``'s), each rounded once to the model's dtype."""
        a, b = a.to(self.device, self.dtype), b.to(self.device, self.dtype)
        self.kernels[slot][part] = [(_kernel(a_e, self.matmul), _kernel(b_e, self.matmul))
                                    for a_e, b_e in zip(a, b, strict=True)]

    def clear(self, slot: int) -> None:
        self.kernels[slot] = [None, None]

    def finish(self, slot: int) -> None:
        """Nothing to do: ``load`` built the kernels (``LoRALinear``'s interface)."""

    def row_slots(self, rows: int) -> torch.Tensor | int | None:
        return self.step.row_slots(rows)

    def add(self, part: str, expert: int, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor | int) -> None:
        index = self.PARTS.index(part)
        if isinstance(slots, int):  # every row on one adapter: no rows to sort out
            experts = self.kernels[slots][index]
            if experts is not None:
                shrink, expand = experts[expert]
                _add_rows(y, expand(shrink(x)), None)
            return
        for slot in torch.unique(slots).tolist():
            experts = self.kernels[slot][index] if slot >= 0 else None
            if experts is None:  # the base model's rows, or an adapter that leaves this part alone
                continue
            shrink, expand = experts[expert]
            rows = (slots == slot).nonzero().squeeze(1)
            if rows.numel() == slots.numel():
                _add_rows(y, expand(shrink(x)), None)
            else:
                _add_rows(y, expand(shrink(x.index_select(0, rows))), rows)


def _kernel(weight: torch.Tensor, matmul: str) -> nn.Module:
    """``x -> x weight^T`` on ``matmul``'s packed kernel where it applies (bf16 on a CPU:
    batch-invariant), else ``nn.Linear``."""
    packed = packed_linear(weight.contiguous(), None, matmul)
    if packed is not None:
        return packed
    plain = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    plain.weight.data = weight.contiguous()
    return plain


def _add_rows(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> None:
    """``y[rows] += delta`` (every row of y where ``rows`` is None). On a CPU, the native
    walk's own kernel (``cpu_ops.add_rows_``: torch's add, rounded the same), so that the
    walk's adapter rows are this path's bit for bit by construction; elsewhere torch's."""
    if (y.device.type == "cpu" and y.dtype in cpu_ops.ACTIVATIONS and y.is_contiguous() and delta.is_contiguous()
            and cpu_ops.available()):
        cpu_ops.add_rows_(y, delta, rows)
    elif rows is None:
        y += delta
    else:
        y.index_add_(0, rows, delta)
