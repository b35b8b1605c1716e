"""Declaring a C++ kernel once: the PyTorch op ``kvloom::<name>`` and its ctypes call.

kvloom's kernels (kvloom/csrc) export a plain C ABI, built in about a second by
kvloom/native.py (no torch headers) and called through ctypes. Raw ctypes checks
nothing: a tensor of the wrong dtype, shape or layout, or a value in the wrong slot,
corrupts memory instead of raising. So each kernel is one :class:`NativeOp`:

- ``schema``: the op in PyTorch's schema language, registered with ``torch.library``
  (a CPU kernel and a fake one, so that FakeTensor, ``torch.compile`` and
  ``torch.library.opcheck`` see through it). Tensors the kernel writes are ``Tensor(a!)``.
- ``tensors``: a :class:`TensorSpec` (dtypes, rank, layout, CPU) for every Tensor
  argument, checked before any pointer reaches C; relations between arguments (shapes
  that must agree) are the op's ``check`` hook. Failures raise
  ``ValueError("kvloom::<name>: <argument> ...")``, under the fake tensors too.
- ``native``: the C function's parameters in its order: schema arguments by bare name
  (typed by the schema) and what the implementation adds (outputs, sizes, strides) with
  a type. The ctypes signature is derived from it: Tensor -> c_void_p (the data pointer,
  passed after the checks), int -> c_int64, int32 -> c_int, float -> c_float.
  tests/kernels/test_op_schemas.py holds every declaration to its C prototype (names,
  types, and const-ness against the schema's mutation marks).

The entry point ``op.call(...)`` (behind each kernels module's typed function) runs the
checks and the CPU implementation directly when nothing could intercept the call (a
plain tensor, no tracing, no dispatch mode, no profiler), else goes through
``torch.ops.kvloom.<name>``: the dispatcher's round trip into a Python kernel costs
about 4 us, more than a small kernel's work, and a decode step makes ~180 native calls.
Both paths run the same checks and the same code.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvloom import native

# Kept alive for the process: a dropped Library unregisters what it defined.
LIBRARY = torch.library.Library("kvloom", "FRAGMENT")
OPS: dict[str, NativeOp] = {}  # every declared op by name (tests walk it)
FUNCTIONS: list[NativeFunction] = []  # every declared C function, ops' and queries'

C_TYPES: dict[str, type] = {"Tensor": ctypes.c_void_p, "Tensor?": ctypes.c_void_p, "int": ctypes.c_int64,
                            "int32": ctypes.c_int, "float": ctypes.c_float}
RESULT_TYPES: dict[str, type | None] = {"()": None, "int": ctypes.c_int64, "int32": ctypes.c_int}
_SCHEMA_TYPES = {"Tensor": "Tensor", "Optional[Tensor]": "Tensor?", "int": "int", "float": "float"}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "float16",
                torch.float64: "float64", torch.int32: "int32", torch.int64: "int64"}
_PARAMETER = re.compile(r"(?:(int32|int|float|Tensor\??)\s+)?(\w+)")


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` while a torch profile runs (engine/profiler.py), for a native
    call that is not a torch op and so would not show there; else nothing (the check
    costs ~0.1 us, a span ~12 us on the CPUs here)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class NativeParam:
    """One parameter of a C function."""

    name: str  # the C prototype's name for it
    type: str  # a key of C_TYPES
    from_schema: bool  # an argument of the op (else the implementation supplies it)
    written: bool  # a Tensor argument the schema marks as mutated, Tensor(a!)


class NativeFunction:
    """A C function of ``csrc/<library>.cpp`` (or a family of variants with one
    signature: ``{variant}`` in the name), its ctypes signature derived from
    ``declaration``, e.g. ``"kvloom_paired_layout(int head_dim, int block_size) -> int32"``.

    ``schema_types`` gives the type of parameters named bare: an op's arguments."""

    def __init__(self, library: str, declaration: str, variants: tuple[str, ...] = ("",),
                 schema_types: dict[str, tuple[str, bool]] | None = None) -> None:
        match = re.fullmatch(r"\s*([\w{}]+)\((.*)\)\s*->\s*(\S+)\s*", declaration, re.S)
        if match is None or match.group(3) not in RESULT_TYPES:
            raise ValueError(f"not a native declaration: {declaration!r}")
        self.library, self.symbol, self.result, self.variants = library, match.group(1), match.group(3), variants
        self.params = tuple(_parameter(text.strip(), schema_types or {}, declaration)
                            for text in match.group(2).split(",") if text.strip())
        self._functions: dict[str, Callable[..., Any]] | None = None
        FUNCTIONS.append(self)

    def symbols(self) -> list[str]:
        return [self.symbol.format(variant=variant) for variant in self.variants]

    def available(self) -> bool:
        """Whether the library builds here (a failure is logged once and remembered)."""
        return native.load_optional(self.library) is not None

    def function(self, variant: str = "") -> Callable[..., Any]:
        """The variant's ctypes function, its signature set; KernelUnavailable where the
        library cannot be built here."""
        functions = self._functions
        if functions is None:
            functions = self._functions = self._load()
        return functions[variant]

    def _load(self) -> dict[str, Callable[..., Any]]:
        library = native.load_optional(self.library)
        if library is None:
            raise native.KernelUnavailable(f"kvloom/csrc/{self.library}.cpp could not be built here (see the log)")
        functions = {}
        for variant, symbol in zip(self.variants, self.symbols(), strict=True):
            function = getattr(library, symbol)
            function.argtypes = [C_TYPES[param.type] for param in self.params]
            function.restype = RESULT_TYPES[self.result]
            functions[variant] = function
        return functions


def _parameter(text: str, schema_types: dict[str, tuple[str, bool]], declaration: str) -> NativeParam:
    match = _PARAMETER.fullmatch(text)
    if match is None:
        raise ValueError(f"bad parameter {text!r} in {declaration!r}")
    declared, name = match.groups()
    if declared is not None:
        return NativeParam(name, declared, from_schema=False, written=False)
    if name not in schema_types:
        raise ValueError(f"{name!r} in {declaration!r} is neither typed nor an argument of the op")
    schema_type, written = schema_types[name]
    return NativeParam(name, schema_type, from_schema=True, written=written)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one Tensor argument must be, checked before its pointer reaches C: a CPU
    tensor of rank ``dim`` whose dtype is in ``dtypes`` or, with ``like``, that other
    argument's dtype; contiguous, or with ``rows`` contiguous in each row (every dim but
    the first), the rows themselves strided as they like."""

    dim: int
    dtypes: tuple[torch.dtype, ...] = ()
    like: str | None = None
    rows: bool = False

    def describe(self, like_dtype: torch.dtype | None) -> str:
        layout = "row-contiguous" if self.rows else "contiguous"
        if self.like is None:
            dtypes = " or ".join(dtype_name(dtype) for dtype in self.dtypes)
        else:
            dtypes = f"{dtype_name(like_dtype)} ({self.like}'s dtype)" if like_dtype else f"{self.like}'s dtype"
        return f"a {layout} {self.dim}-D {dtypes} CPU tensor"


def rows_contiguous(tensor: torch.Tensor) -> bool:
    """Whether every dim but the first is laid out contiguously (dim 0 may be strided)."""
    if tensor.dim() == 2:  # the common case, without the general loop's cost
        return tensor.stride(1) == 1 or tensor.shape[1] == 1
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _describe_tensor(tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        return type(tensor).__name__
    layout = "" if tensor.is_contiguous() else ", not contiguous"
    return f"{list(tensor.shape)} {dtype_name(tensor.dtype)} on {tensor.device}{layout}"


# What may intercept an op call (module references: read on every call).
_is_compiling = torch.compiler.is_compiling
_dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)
_profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def _no_relations(*args: Any) -> None:
    return None


def _compile(name: str, source: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """The function ``name`` defined by ``source`` (made from a declaration, never from input)."""
    exec(compile(source, f"<kvloom native op: {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


class NativeOp:
    """A C++ kernel as the op ``kvloom::<name>`` (see the module doc).

    The implementation, the fake and the optional cross-argument ``check`` are given with
    the decorators :meth:`implementation`, :meth:`fake` and :meth:`check`; each takes the
    schema's arguments in order. The first argument is a Tensor (its type picks the path).

    The TensorSpecs are compiled into one straight-line function per op, :meth:`validate`
    (as ``dataclasses`` writes ``__init__``): a loop over the specs cost three times as
    much, about 1 us a call more, on ops whose whole call is a few microseconds."""

    def __init__(self, schema: str, *, library: str, native: str, tensors: dict[str, TensorSpec],
                 variants: tuple[str, ...] = ("",)) -> None:
        self.name = schema[:schema.index("(")]
        arguments = torch._C.parse_schema(f"kvloom::{schema}").arguments  # checked before anything registers
        types = {argument.name: (_SCHEMA_TYPES.get(str(argument.type), str(argument.type)),
                                 argument.alias_info is not None and argument.alias_info.is_write)
                 for argument in arguments}
        tensor_arguments = {name for name, (kind, _) in types.items() if kind in ("Tensor", "Tensor?")}
        if set(tensors) != tensor_arguments or types[arguments[0].name][0] != "Tensor":
            raise ValueError(f"kvloom::{self.name}: the first argument must be a Tensor, and every Tensor "
                             f"argument needs a TensorSpec: {sorted(tensor_arguments)} vs {sorted(tensors)}")
        if any(spec.like is not None and types.get(spec.like, ("",))[0] != "Tensor" for spec in tensors.values()):
            raise ValueError(f"kvloom::{self.name}: a TensorSpec's like must name a Tensor that is always given")
        self.native = NativeFunction(library, native, variants, types)
        LIBRARY.define(schema)
        self.overload = getattr(torch.ops.kvloom, self.name).default
        self.tensors = tensors
        self.arguments = tuple(argument.name for argument in arguments)
        # Arguments whose dtype others follow come first: a message never cites a bad dtype.
        self._ordered = sorted(tensors, key=lambda name: tensors[name].like is not None)
        self._optional = {name for name in tensors if types[name][0] == "Tensor?"}
        self._relations: Callable[..., None] = _no_relations
        self.validate, self._validate_fake = self._compile_validate(False), self._compile_validate(True)
        self.call: Callable[..., Any] = self.overload  # until the implementation is declared
        OPS[self.name] = self

    # ---- declaration -----------------------------------------------------------------
    def check(self, function: Callable[..., None]) -> Callable[..., None]:
        """Decorator: the checks between arguments (shapes that must agree), run after the
        TensorSpecs on real and fake tensors alike; they raise :meth:`error`. Declared
        before the implementation, which is compiled with them."""
        if self.call is not self.overload:
            raise RuntimeError(f"kvloom::{self.name}: declare the check before the implementation")
        self._relations = function
        self.validate, self._validate_fake = self._compile_validate(False), self._compile_validate(True)
        return function

    def implementation(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the CPU kernel (it calls :meth:`function`), registered behind the checks.

        It also makes :attr:`call`, the op's entry point: straight to the checks and this
        function when nothing could intercept the call (a plain tensor first, no tracing,
        no dispatch mode, no profiler), else through ``torch.ops.kvloom.<name>``: the
        dispatcher's round trip into Python costs about 4 us, more than a small kernel's
        work, and a decode step makes ~180 native calls."""
        arguments = ", ".join(self.arguments)
        namespace = {"_validate": self.validate, "_implementation": function}
        LIBRARY.impl(self.name, _compile("checked", f"""
def checked({arguments}):
    _validate({arguments})
    return _implementation({arguments})
""", namespace), "CPU")
        namespace.update(_Tensor=torch.Tensor, _is_compiling=_is_compiling, _dispatch_modes=_dispatch_modes,
                         _profiling=_profiling, _overload=self.overload)
        self.call = _compile("call", f"""
def call({arguments}):
    if type({self.arguments[0]}) is _Tensor and not (_is_compiling() or _dispatch_modes() or _profiling()):
        _validate({arguments})
        return _implementation({arguments})
    return _overload({arguments})
""", namespace)
        return function

    def fake(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: the output's metadata from the inputs' (no data is read), behind the
        checks (which let meta tensors through here: shape propagation is no C call)."""
        def checked(*args: Any) -> Any:
            self._validate_fake(*args)
            return function(*args)

        torch.library.register_fake(f"kvloom::{self.name}", checked, lib=LIBRARY)
        return function

    # ---- use -------------------------------------------------------------------------
    def function(self, variant: str = "") -> Callable[..., Any]:
        """The C function (of that variant) the implementation calls."""
        return self.native.function(variant)

    def available(self) -> bool:
        """Whether the C++ source builds here; where not, callers run their reference."""
        return self.native.available()

    def error(self, argument: str, message: str) -> ValueError:
        return ValueError(f"kvloom::{self.name}: {argument} {message}")

    # ---- the checks --------------------------------------------------------------------
    def _compile_validate(self, fake: bool) -> Callable[..., None]:
        """``validate(*arguments)``: the TensorSpecs as one expression, then the ``check``
        hook; on a failure, :meth:`_explain` finds the argument and raises. ``fake``: for
        the fake kernel, where meta tensors are welcome too."""
        namespace: dict[str, Any] = {"_explain": self._explain, "_relations": self._relations,
                                     "_rows_contiguous": rows_contiguous, "_fake": fake}
        terms = []
        for name in self._ordered:
            spec = self.tensors[name]
            if spec.like is None:
                namespace[f"_dtypes_{name}"] = spec.dtypes
                dtype = f"{name}.dtype in _dtypes_{name}"
            else:
                dtype = f"{name}.dtype is {spec.like}.dtype"
            if not spec.rows:
                layout = f"{name}.is_contiguous()"
            elif spec.dim == 2:  # rows_contiguous's first case, inline
                layout = f"({name}.stride(1) == 1 or {name}.shape[1] == 1)"
            else:
                layout = f"_rows_contiguous({name})"
            device = f"({name}.is_cpu or {name}.is_meta)" if fake else f"{name}.is_cpu"
            term = f"({name}.dim() == {spec.dim} and {device} and {dtype} and {layout})"
            terms.append(f"({name} is None or {term})" if name in self._optional else term)
        arguments = ", ".join(self.arguments)
        return _compile("validate", f"""
def validate({arguments}):
    try:
        valid = {" and ".join(terms)}
    except AttributeError:  # not a tensor
        valid = False
    if not valid:
        _explain(({arguments},), _fake)
    _relations({arguments})
""", namespace)

    def _explain(self, args: tuple[Any, ...], fake: bool) -> None:
        """Raise the ValueError for the first argument that fails its TensorSpec."""
        for name in self._ordered:
            spec, tensor = self.tensors[name], args[self.arguments.index(name)]
            like = None if spec.like is None else args[self.arguments.index(spec.like)]
            if tensor is None and name in self._optional:
                continue
            if not (isinstance(tensor, torch.Tensor) and tensor.dim() == spec.dim
                    and (tensor.is_cpu or (fake and tensor.is_meta))
                    and tensor.dtype in ((like.dtype,) if spec.like is not None else spec.dtypes)
                    and (rows_contiguous(tensor) if spec.rows else tensor.is_contiguous())):
                raise self.error(name, f"must be {spec.describe(getattr(like, 'dtype', None))}, "
                                       f"got {_describe_tensor(tensor)}")
        raise AssertionError(f"kvloom::{self.name}: a check failed that no TensorSpec explains")
