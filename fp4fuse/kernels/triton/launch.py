"""How fp4fuse's launchers launch a Triton kernel: through ``torch.library.wrap_triton`` while a
dispatcher-based tracer (make_fx / AOT autograd, as in ``fp4fuse.passes.lowering``) records the call,
and otherwise through a cache of compiled kernels that skips Triton's per-call dispatch.

    traceable(_quant_kernel)[grid](x, ..., BLOCKS=128, num_warps=4)

``wrap_triton`` is what makes a launch traceable: under a tracer it becomes a
``triton_kernel_wrapper_*`` node that Inductor's generated code launches itself. Outside one it
still dispatches the launch through that higher-order op's eager implementation, which costs
hundreds of microseconds of host time per launch, so eager calls launch the kernel directly.

A direct ``kernel[grid](...)`` still spends tens of microseconds of host time in ``JITFunction.run``
(argument binding, specialization, cache-key strings) before the driver call; an eager decode step
is host-bound on it (benchmarks/bench_host.py; results in benchmarks/results/). ``FastKernel``
keeps, per kernel, the compiled kernel that Triton's own dispatch returned for a launch, under a
key that holds everything Triton specializes a launch on -- each tensor's dtype and whether its
address is a multiple of 16 bytes, each host-side TMA descriptor's class, dtype, block shape and
shared-memory layout, each other argument's exact value (so an integer's divisibility, its
int32/int64 type and equality to 1 all follow), every keyword (constexprs and launch options) and
the current device -- and launches a cache hit through the compiled kernel's
own launcher. A miss, a Triton version it was not written for, a launch hook (profilers such as
proton) or an argument it cannot key takes Triton's path. The launcher and its argument order are
those of ``JITFunction.run`` in Triton 3.2 to 3.9.

A hit still rebuilds its key from every argument, and a kernel with host-side TMA descriptors
still has the driver encode each descriptor on every launch. ``FastKernel.prepare`` launches once
and returns a ``Relaunch``: the compiled kernel's C launcher with every argument fixed but the
tensors (and the stream), each descriptor encoded once. Its caller keys it on what it fixes
(``Relaunch``'s contract); ``fp4fuse.kernels.triton.mm_hopper`` does so for the Gluon GEMM's calls
in a compiled graph, which repeat with the same buffers forward after forward.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import torch
import triton
from torch.library import wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["FastKernel", "Relaunch", "launch_hooks_set", "traceable", "tracing", "triton_version"]

#: Triton versions whose ``CompiledKernel.run`` takes ``JITFunction.run``'s positional layout:
#: ``(grid x, y, z, stream, function, packed_metadata, launch_metadata, enter hook, exit hook, *args)``.
_KNOWN_TRITON = ((3, 2), (3, 9))
#: Cached launches per kernel before the cache is cleared (distinct shapes: one entry each).
MAX_ENTRIES = 4096


def triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


_FAST_OK = _KNOWN_TRITON[0] <= triton_version() <= _KNOWN_TRITON[1]
#: The NVIDIA launcher's fixed leading arguments (grid x, y, z, stream, function, cooperative, PDL,
#: global and profile scratch, packed metadata, launch metadata, enter and exit hooks) in the one
#: layout ``Relaunch`` is written for (Triton 3.6's ``driver._BASE_ARGS_FORMAT``).
_RELAUNCH_BASE_FORMAT = "iiiKKppOOOOOO"


@functools.cache
def _descriptor_types() -> tuple[type, ...]:
    """Triton's host-side TMA descriptor classes in this release (Triton's and Gluon's), imported
    on first use (Gluon's import is not free and most kernels take none)."""
    found = []
    for module, name in (("triton.tools.tensor_descriptor", "TensorDescriptor"),
                         ("triton.experimental.gluon.nvidia.hopper", "TensorDescriptor")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _arg_key(value: Any) -> Any:
    """What Triton specializes a launch on, for one positional argument (KeyError: not keyable).
    A host-side TMA descriptor is specialized on its class, its tensor's dtype, its block shape and
    (Gluon) its shared-memory layout; its address, shape and strides are launch arguments (the
    launcher encodes the descriptor per launch). Every other field of it (padding, layout, ...)
    is keyed, so a field a later Triton adds makes the key finer, never coarser."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, (bool, int, float)) or value is None:
        return type(value), value
    if isinstance(value, _descriptor_types()):
        return type(value), value.base.dtype, *(_hashable(getattr(value, f)) for f in _specialized_fields(type(value)))
    raise KeyError(type(value).__name__)


#: A descriptor's fields that its launcher passes per launch (not specialized on).
_DESCRIPTOR_ARGS = frozenset(("base", "shape", "strides"))


@functools.cache
def _specialized_fields(descriptor_type: type) -> tuple[str, ...]:
    """The fields of a descriptor class the key holds: all but ``_DESCRIPTOR_ARGS`` (read once per
    class: the key is built on every launch)."""
    return tuple(f.name for f in dataclasses.fields(descriptor_type) if f.name not in _DESCRIPTOR_ARGS)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _hook_set(hook: Any) -> bool:
    """A launch hook that would run: not None and, for Triton's ``HookChain``, holding a call."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_hooks_set() -> bool:
    """Whether Triton's launch enter / exit hooks are set (a profiler such as proton): launches must
    then take Triton's own path, which calls them."""
    runtime = triton.knobs.runtime
    return _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook)


def tracing() -> bool:
    """Whether a dispatch mode (a tracer, fake tensors) is active: tensors may have no storage."""
    return _get_current_dispatch_mode() is not None


class FastKernel:
    """``kernel[grid](*args, **meta)`` for a ``triton.jit`` kernel, with the compiled-kernel cache of
    the module docstring. ``args`` are the kernel's leading parameters, positionally; every later
    parameter comes as a keyword or takes its default."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.params = [(p.name, p.default) for p in kernel.params]
        self.cache: dict[tuple, tuple] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if callable(grid):  # a grid computed from the bound arguments: Triton's path
            return self.kernel[grid]
        return functools.partial(self.launch, grid)

    def launch(self, grid: tuple[int, ...], *args: Any, **meta: Any) -> tuple[int, tuple] | None:
        """Launches ``kernel[grid](*args, **meta)``; returns the ``(device, cache entry)`` it launched
        with, or None where it took Triton's path without caching an entry for it (an argument it
        cannot key, another Triton, a launch hook set)."""
        try:
            device = torch._C._cuda_getDevice()
            key = (device, tuple(meta.items()), *map(_arg_key, args))
            hit = self.cache.get(key)  # hashes every keyword value
        except (KeyError, TypeError):  # an argument Triton may specialize in ways not keyed here
            self.kernel[grid](*args, **meta)
            return None
        if hit is None or launch_hooks_set():
            entry = self._miss(key, grid, args, meta)
            return None if entry is None or launch_hooks_set() else (device, entry)
        run, function, packed_metadata, tail = hit
        stream = torch._C._cuda_getCurrentRawStream(device)  # what Triton's dispatch launches on
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        run(gx, gy, gz, stream, function, packed_metadata, None, None, None, *args, *tail)
        return device, hit

    def prepare(self, grid: tuple[int, ...], *args: Any, **meta: Any) -> Relaunch | None:
        """``launch(grid, *args, **meta)``, and a ``Relaunch`` that repeats it, or None where this
        launch cannot be prepared (no fast path for it, a launcher of another layout, scratch
        memory, a launch hook set): the caller then launches through ``launch`` each time."""
        launched = self.launch(grid, *args, **meta)
        if launched is None:
            return None
        device, (run, function, packed_metadata, tail) = launched
        return Relaunch.of(run, tuple(grid), function, packed_metadata, (*args, *tail), device)

    def _miss(self, key: tuple, grid: tuple[int, ...], args: tuple, meta: dict) -> tuple | None:
        """Triton's dispatch (it compiles or finds the kernel, and launches); the cache entry it
        adds, or None where the result is not a ``CompiledKernel`` (no fast path for it)."""
        compiled = self.kernel[grid](*args, **meta)
        try:
            entry = (compiled.run, compiled.function, compiled.packed_metadata,
                     tuple(meta[name] if name in meta else default for name, default in self.params[len(args):]))
        except AttributeError:  # not a CompiledKernel (another Triton): no fast path for it
            return None
        if len(self.cache) >= MAX_ENTRIES:
            self.cache.clear()
        self.cache[key] = entry
        return entry


@dataclasses.dataclass(frozen=True, slots=True)
class Relaunch:
    """One launch of a compiled kernel, prepared to repeat: ``relaunch(*tensors)`` launches it on
    the current stream with ``tensors`` in the places the prepared launch had tensors, in order;
    every other argument is the prepared one, each host-side TMA descriptor already encoded.

    Valid only for the launch it was prepared from in everything but those tensors: the same
    device, grid and scalars; tensors of the same dtypes and 16-byte alignment (what Triton
    specialized the compiled kernel on); and each descriptor's tensor at the same address with the
    same shape and strides (an encoded descriptor holds them). The caller keys a ``Relaunch`` on
    all of that, and takes Triton's own path instead while ``launch_hooks_set()`` (a relaunch
    calls no hook). A ``Relaunch`` keeps no tensor alive."""
    launcher: Any  # the compiled kernel's C launcher (the driver's ``launch``)
    head: tuple  # grid x, y, z
    function: int
    flags: tuple[bool, bool]  # cooperative grid, programmatic dependent launch
    packed_metadata: Any
    template: tuple  # the kernel's arguments, descriptors expanded, None at each tensor's place
    slots: tuple[int, ...]  # the tensors' places in ``template``
    device: int

    @classmethod
    def of(cls, run: Any, grid: tuple[int, ...], function: int, packed_metadata: Any, kernel_args: tuple,
           device: int) -> Relaunch | None:
        """From a compiled kernel's launcher object ``run`` (``CompiledKernel.run``) and the
        kernel's arguments in parameter order; None where ``run`` is not Triton 3.6's NVIDIA launcher
        (argument layout, descriptor handling) or the launch needs scratch memory."""
        try:
            from triton.backends.nvidia import driver
        except ImportError:
            return None
        if (getattr(driver, "_BASE_ARGS_FORMAT", None) != _RELAUNCH_BASE_FORMAT
                or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)):
            return None
        launcher = run.launch
        closure = dict(zip(launcher.__code__.co_freevars, (c.cell_contents for c in launcher.__closure__))) \
            if getattr(launcher, "__closure__", None) else {}
        descriptors, descriptor_meta = frozenset(), ()
        if "launcher" in closure:  # the driver's descriptor-expanding wrapper around the C launcher
            descriptors, descriptor_meta = closure.get("tensordesc_indices"), closure.get("tensordesc_meta")
            launcher = closure["launcher"]
            if descriptors is None or descriptor_meta is None or None in descriptor_meta:
                return None
        template, slots, metas = [], [], iter(descriptor_meta)
        for index, value in enumerate(kernel_args):
            if index in descriptors:
                template.extend(driver.make_tensordesc_arg(value, next(metas)))
            elif isinstance(value, torch.Tensor):
                slots.append(len(template))
                template.append(None)
            else:
                template.append(value)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        return cls(launcher, (gx, gy, gz), function, (run.launch_cooperative_grid, run.launch_pdl),
                   packed_metadata, tuple(template), tuple(slots), device)

    def __call__(self, *tensors: torch.Tensor) -> None:
        args = list(self.template)
        for slot, tensor in zip(self.slots, tensors, strict=True):
            args[slot] = tensor
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        self.launcher(*self.head, stream, self.function, *self.flags, None, None, self.packed_metadata,
                      None, None, None, *args)


# one FastKernel per kernel, by identity (a JITFunction hashes its source key under a lock)
_FAST: dict[int, FastKernel] = {}


def _fast(kernel: Any) -> FastKernel:
    fast = _FAST.get(id(kernel))
    if fast is None or fast.kernel is not kernel:
        fast = _FAST[id(kernel)] = FastKernel(kernel)
    return fast


def traceable(kernel: Any) -> Any:
    """``wrap_triton(kernel)`` when a dispatch mode (a tracer) is active; otherwise a launcher with
    ``kernel[grid](...)``'s call form: ``FastKernel`` for a compiled ``triton.jit`` kernel on a
    known Triton, the kernel itself else (Triton's interpreter, other versions)."""
    if tracing():
        return wrap_triton(kernel)
    if _FAST_OK and isinstance(kernel, triton.runtime.jit.JITFunction):
        return _fast(kernel)
    return kernel
