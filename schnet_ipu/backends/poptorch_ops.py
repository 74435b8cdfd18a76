"""Refuse, on the CPU, the aten ops PopTorch 3.4.0 would refuse on the IPU.

    pred, ops = record_aten_ops(lambda: model(batch))  # ops: {"aten::index_select", ...}
    loss = check_poptorch_ops(lambda: loss_fn(model, batch))  # UnsupportedOpError if unmapped

How PopTorch 3.4.0 (built against torch 2.0.1) sees a model, and how this module mirrors it
(paths in github:graphcore/poptorch at tag ``sdk/poptorch/3.4.0``):

* It traces the forward pass (and the loss inside it) only; PopART differentiates the traced
  graph itself (``poptorch/source/dispatch_tracer/README.md``). So the check runs a forward
  and a loss, never a backward.
* Ops reach PopTorch through torch's dispatcher: a boxed fallback for the ``IPU`` and
  ``AutogradIPU`` keys (``dispatch_tracer/RegisterAtenOverloads.cpp``) turns each call into a
  JIT node named after the op's schema, without its overload
  (``dispatch_tracer/CommonHelperFunctions.cpp``: ``createAtenTarget``). A
  ``TorchDispatchMode`` sees the same calls: torch's ``CompositeImplicitAutograd`` ops are
  already decomposed above it. Two differences are mirrored here. (1) An op with a
  ``CompositeExplicitAutograd`` kernel runs that kernel on the IPU (torch prefers it to a
  backend fallback) unless PopTorch registered the op for the IPU key itself
  (``dispatch_tracer/RegisterOptionalAtenOps.cpp.inc``), so PopTorch sees the ops the kernel
  calls (``zeros`` arrives as ``empty`` + ``zero_``): the recorder runs that kernel and
  records its calls instead. (2) The few ``CompositeImplicitAutograd`` ops PopTorch
  registers for the IPU key (``one_hot``, ``dropout``, ...) reach it undecomposed, while
  here they are seen decomposed: the check is stricter than PopTorch for those, never
  laxer.
* The dispatcher implements a few ops itself (``copy_``, ``detach``, ``empty``...; same two
  files) and ``poptorch/source/AliasProcessing.cpp`` removes ``alias``. Two of them exist
  only to fail in a traced model and are refused here: ``item`` ("only supported in eager
  mode") and ``_local_scalar_dense`` (a copy to the CPU in the middle of the graph).
* In-place ops are checked as their out-of-place form: ``poptorch/source/InplaceOps.cpp``
  (``outplaceKind``) drops the trailing ``_`` (``zero_`` -> ``zeros_like`` and ``fill_`` ->
  ``full_like``, ``include/poptorch/InplaceOpsPyTorch.hpp_nolint``), except ``copy_``,
  ``normal_``, ``uniform_``, ``random_`` and ``exponential_``, which stay in place.
* Views are traced, but "the aliasing property of views with respect to in-place
  operations should not be relied on" (``docs/user_guide/supported_ops.rst``): an in-place
  op writing into a view may leave the viewed tensor unchanged on the IPU. The check refuses
  such writes too, naming the op.
* Inputs, parameters and buffers are moved to the IPU, and the factories of
  ``python/_poplar_executor.py`` ``_SetDefaultDeviceType`` get ``device="ipu"`` when called
  without one; any other tensor stays on the CPU, and an op mixing it with IPU tensors
  raises "Expected an IPU tensor" (``dispatch_tracer/TypeInferenceHandler.cpp``). Given the
  IPU's tensors, the check follows them with a ``TorchFunctionMode`` and refuses such calls.
* Every node is then lowered by its handler, registered with ``registerHandler`` in
  ``poptorch/source/popart_canonicalization/*.cpp``; an aten node left without one makes
  ``poptorch/source/ErrorOnUnsupportedAten.cpp`` raise "Unsupported ops found in compiled
  model".

The op lists are ``poptorch_ops_3.4.0.txt`` beside this file, derived from that source by
``scripts/derive_poptorch_ops.py`` (provenance in its header).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

T = TypeVar("T")

OPS_FILE = Path(__file__).with_name("poptorch_ops_3.4.0.txt")
# poptorch/source/InplaceOps.cpp: onlyInplaceOps() and outplaceKind()
ONLY_INPLACE = frozenset({"copy_", "normal_", "uniform_", "random_", "exponential_"})
INPLACE_TO_OUT_OF_PLACE = {"zero_": "zeros_like", "fill_": "full_like"}
# Implemented by the dispatcher only to fail inside a traced model: ``item`` raises "only
# supported in eager mode", ``_local_scalar_dense`` is a copy to the CPU mid-graph
# (poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp ``item``, ``localScalarDense``)
HOST_SYNC = frozenset({"aten::item", "aten::_local_scalar_dense"})
# python/_poplar_executor.py ``_SetDefaultDeviceType``: called without ``device`` inside the
# model, these are given device="ipu"; any other tensor made there stays on the CPU
IPU_FACTORIES = frozenset(
    {"arange", "empty", "full", "full_like", "linspace", "logspace", "ones", "rand", "randint",
     "randn", "randperm", "range", "tensor", "zeros", "zeros_like", "normal"}
)  # fmt: skip

__all__ = ["UnsupportedOpError", "check_poptorch_ops", "record_aten_ops"]


class UnsupportedOpError(RuntimeError):
    """The traced forward + loss uses aten ops PopTorch 3.4.0 cannot lower (named in the
    message)."""


@lru_cache(maxsize=1)
def load_op_lists(path: Path = OPS_FILE) -> dict[str, frozenset[str]]:
    """The ``[handlers]``, ``[dispatcher]`` and ``[ipu_key]`` sections of ``path``."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), set())
        elif current is None:
            raise ValueError(f"{path}: op {line!r} before any [section]")
        else:
            current.add(line)
    missing = {"handlers", "dispatcher", "ipu_key"} - set(sections)
    if missing:
        raise ValueError(f"{path}: missing sections {sorted(missing)}")
    return {name: frozenset(ops) for name, ops in sections.items()}


def _schema_key(func: torch._ops.OpOverload) -> str:
    """``name.overload`` as PopTorch registers it (``name`` for the default overload)."""
    name = func._schema.name.split("::", 1)[1]
    overload = func._schema.overload_name
    return f"{name}.{overload}" if overload else name


class _AtenRecorder(TorchDispatchMode):
    """Collects the aten ops (``"aten::name"``, no overload) PopTorch's dispatcher would see,
    and the in-place ones among them that wrote into a view."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.views_written: set[str] = set()
        self.ipu_key = load_op_lists()["ipu_key"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        explicit = torch._C.DispatchKey.CompositeExplicitAutograd
        if (
            func.namespace == "aten"
            and _schema_key(func) not in self.ipu_key
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), explicit)
        ):
            with self:  # record the calls the composite kernel makes, as the IPU would see
                return func._op_dk(explicit, *args, **kwargs)
        name = func._schema.name
        self.ops.add(name)
        target = args[0] if args else None
        in_place = poptorch_node_kind(name) != name.split("::", 1)[-1]
        if in_place and isinstance(target, torch.Tensor) and target._is_view():
            self.views_written.add(name)
        return func(*args, **kwargs)


class _HostTensors(TorchFunctionMode):
    """Follows which tensors of a traced call live on the IPU: the model's inputs, weights
    and buffers, what is computed from them, and tensors made by the factories PopTorch sends
    to the IPU (``IPU_FACTORIES``; one given a ``device`` is taken to name the IPU). A call
    that mixes an IPU tensor with any other tensor (a plain tensor attribute, one made from
    numpy, a ``.cpu()`` copy) is recorded: PopTorch raises "Expected an IPU tensor"
    (poptorch/source/dispatch_tracer/TypeInferenceHandler.cpp ``toMeta``)."""

    def __init__(self, device_tensors: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._on_ipu: dict[int, weakref.ref] = {}
        self.mixed: set[str] = set()
        for tensor in device_tensors:
            self._mark(tensor)

    def _mark(self, tensor: torch.Tensor) -> None:
        self._on_ipu[id(tensor)] = weakref.ref(tensor)

    def _is_on_ipu(self, tensor: torch.Tensor) -> bool:
        ref = self._on_ipu.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_ipu = [self._is_on_ipu(t) for t in tensors]
        if any(on_ipu) and not all(on_ipu):
            self.mixed.add(name)
        moved_to_host = name == "cpu" or (name == "to" and "cpu" in map(str, args[1:]))
        made_on_ipu = not tensors and (name in IPU_FACTORIES or "device" in kwargs)
        if (any(on_ipu) and not moved_to_host) or made_on_ipu:
            for out in tree_flatten(result)[0]:
                if isinstance(out, torch.Tensor):
                    self._mark(out)
        return result


def _record(
    fn: Callable[[], T], device_tensors: Iterable[torch.Tensor] | None = None
) -> tuple[T, _AtenRecorder, set[str]]:
    """``fn()`` under the aten recorder; with ``device_tensors``, also the calls that mixed
    them (and what came of them) with host tensors."""
    recorder = _AtenRecorder()
    if device_tensors is None:
        with recorder:
            return fn(), recorder, set()
    host = _HostTensors(device_tensors)
    with host, recorder:
        result = fn()
    return result, recorder, host.mixed


def record_aten_ops(fn: Callable[[], T]) -> tuple[T, set[str]]:
    """Run ``fn`` under a ``TorchDispatchMode``; return its result and the aten ops it ran
    (``"aten::name"``, as PopTorch names its nodes), composite kernels expanded as on the IPU
    (see the module docstring)."""
    result, recorder, _ = _record(fn)
    return result, {op for op in recorder.ops if op.startswith("aten::")}


def poptorch_node_kind(op: str) -> str:
    """The name PopTorch's handlers are looked up by: out-of-place for in-place ops
    (``poptorch/source/InplaceOps.cpp``)."""
    name = op.split("::", 1)[-1]
    if name in ONLY_INPLACE or len(name) < 2 or name[-2] == "_" or name[-1] != "_":
        return name  # not in place (``__and__`` is not), or only exists in place
    return INPLACE_TO_OUT_OF_PLACE.get(name, name[:-1])


def unsupported_ops(ops: set[str]) -> set[str]:
    """The ops in ``ops`` (``"aten::name"``) PopTorch 3.4.0 has neither a handler nor a
    dispatcher implementation for."""
    lists = load_op_lists()
    return {
        op
        for op in ops
        if op.split("::", 1)[-1] not in lists["dispatcher"]
        and poptorch_node_kind(op) not in lists["handlers"]
    }


def check_poptorch_ops(
    fn: Callable[[], T], device_tensors: Iterable[torch.Tensor] | None = None
) -> T:
    """Run ``fn`` (a forward + loss, no backward inside); raise :class:`UnsupportedOpError`
    naming every aten op PopTorch 3.4.0 could not lower, every in-place write into a view,
    every copy to the host and, given the tensors that live on the IPU (``device_tensors``:
    the model's inputs, parameters and buffers), every call mixing in a tensor made on the
    CPU; else return ``fn``'s result."""
    result, recorder, mixed = _record(fn, device_tensors)
    bad = unsupported_ops({op for op in recorder.ops if op.startswith("aten::")})
    synced = recorder.ops & HOST_SYNC
    problems = []
    if bad:
        problems.append(f"no handler in PopTorch 3.4.0 for {', '.join(sorted(bad))}")
    if synced:
        problems.append(
            f"a copy to the host inside the model (e.g. .item(), float(tensor)), only "
            f"supported in eager mode: {', '.join(sorted(synced))}"
        )
    if mixed:
        problems.append(
            f"Expected an IPU tensor: {', '.join(sorted(mixed))} got a tensor made on the CPU "
            "(register it as a buffer, or create it inside forward without device=)"
        )
    if recorder.views_written:
        problems.append(
            f"in-place writes into a view, whose aliasing PopTorch does not keep: "
            f"{', '.join(sorted(recorder.views_written))}"
        )
    if problems:
        raise UnsupportedOpError(
            f"Unsupported ops found in compiled model: {'; '.join(problems)}. Use model.ops=ipu,"
            f" ops listed in {OPS_FILE.name}, and out-of-place ops on views."
        )
    return result
