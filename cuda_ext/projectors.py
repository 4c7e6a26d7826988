"""GPU projectors with trak_core's contract: ``project(grads, model_id) → (B, proj_dim)`` float32.

``CudaDenseProjector`` (kind ``"dense"``) and ``CudaSJLTProjector`` (kind ``"sjlt"``) compute the same
projection as trak_core's ``DenseProjector`` and ``SJLTProjector`` (same seed ⇒ same result up to float
rounding; their ``spec()`` is the same, so a store written on the GPU is a store of the CPU projector).
Three backends, chosen at construction:

* ``"kernel"``: our CUDA kernels (cuda_ext/kernels.cu), built at first use;
* ``"torch"``: the same matrix generated block-wise on the GPU with torch ops, then ``addmm`` (no build);
* ``"cpu"``: trak_core's CPU projector.

``backend="auto"`` (default) takes the first that works for ``device`` and, when it cannot give the GPU
path asked for, says why in a one-line :class:`CudaFallbackWarning`: no CUDA (→ the CPU projector), or the
kernels failed to build (→ the torch GPU path). Before its first kernel projection in a process, each
projector checks its kernel against the torch path on a small probe (:mod:`cuda_ext.selfcheck`); on a
mismatch or an error it uses the torch path (one :class:`CudaSelfCheckWarning` line), or raises
:class:`CudaBackendError` where ``backend="kernel"`` was asked for.
"""

from __future__ import annotations

import math
import warnings
from enum import Enum

import torch
from torch import Tensor

from trak_core.errors import BadInputError
from trak_core.projection import counter_rng
from trak_core.projection.projectors import (
    AbstractProjector,
    DenseProjector,
    ProjectionType,
    as_proj_type,
    check_dims,
    register_projector,
)

from . import _build, selfcheck, torch_path
from .selfcheck import CudaBackendError, CudaFallbackWarning, CudaSelfCheckWarning

__all__ = [
    "CudaFallbackWarning",
    "CudaSelfCheckWarning",
    "CudaBackendError",
    "CudaDenseProjector",
    "CudaSJLTProjector",
    "CudaProjector",
    "make_cuda_projector",
    "register_projectors",
    "ALGOS",
    "BACKENDS",
]

ALGOS = ("auto", "fma", "tc1", "tc2", "tc3")
BACKENDS = ("auto", "kernel", "torch", "cpu")
_ALGO_CODE = {"fma": 0, "tc1": 1, "tc2": 2, "tc3": 3}
_KIND_CODE = {ProjectionType.rademacher: 0, ProjectionType.normal: 1}


def _fallback(owner: str, target: str, reason: str) -> None:
    msg = f"cuda_ext: {owner} falls back to {target}: {reason}"
    warnings.warn(msg.replace("\n", " "), CudaFallbackWarning, stacklevel=4)


def _resolve_backend(owner: str, device, backend: str) -> tuple[str, torch.device, str | None]:
    """(backend, device, fallback reason or None)."""
    if backend not in BACKENDS:
        raise BadInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    dev = torch.device(device)
    if backend == "cpu" or (backend == "auto" and dev.type == "cpu"):
        return "cpu", torch.device("cpu"), None
    if backend == "torch":
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        return "torch", dev, None
    if dev.type != "cuda":
        raise BadInputError(f"{owner}: device must be 'cuda' or 'cuda:N' for the GPU backends, got {str(dev)!r}")
    no_cuda = _build.cuda_unavailable_reason()
    if no_cuda is not None:
        if backend == "kernel":
            raise CudaBackendError(f"{owner}: backend='kernel' needs CUDA: {no_cuda}")
        return "cpu", torch.device("cpu"), no_cuda
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if _build.load_extension() is None:
        reason = _build.unavailable_reason() or "the CUDA kernels are unavailable"
        if backend == "kernel":
            raise CudaBackendError(f"{owner}: backend='kernel' is unavailable: {reason}")
        return "torch", dev, reason
    return "kernel", dev, None


def _pieces(grads) -> list[Tensor]:
    if isinstance(grads, dict):
        return [g.reshape(g.shape[0], -1) for g in grads.values()]
    return [grads]


def _as_kernel_input(x: Tensor, device: torch.device) -> Tensor:
    x = x.to(device, non_blocking=True)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.to(torch.float32)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x


def _flat_on(grads, device: torch.device) -> Tensor:
    pieces = [p.to(device, non_blocking=True) for p in _pieces(grads) if p.shape[1] > 0]
    x = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.to(torch.float32)
    return x


class _GpuProjectorBase(AbstractProjector):
    """Backend choice, the CPU delegate and the common bookkeeping."""

    _cpu_target = "the CPU projector"

    def __init__(self, grad_dim, proj_dim, seed, proj_type, device, dtype, backend, model_id) -> None:
        check_dims(grad_dim, proj_dim)
        super().__init__(grad_dim, proj_dim, seed, as_proj_type(proj_type), device)
        if seed < 0:
            raise BadInputError(f"seed must be non-negative, got {seed}")
        self.dtype = dtype
        self.model_id = model_id
        owner = type(self).__name__
        self.requested_device = device
        self.requested_backend = backend
        self.backend, self._device, self.fallback_reason = _resolve_backend(owner, device, backend)
        self.device = self._device
        self._self_checked = False
        if self.fallback_reason is not None:
            target = self._cpu_target if self.backend == "cpu" else "the pure-torch GPU path"
            _fallback(owner, target, self.fallback_reason)

    def _check_label(self) -> str:
        """The algorithm part of the self-check's cache key (and of its warning)."""
        raise NotImplementedError

    def _self_check(self, model_id: int) -> str | None:
        """Run the kernel against the torch path on the probes (see :mod:`cuda_ext.selfcheck`)."""
        raise NotImplementedError

    def _ensure_checked(self, model_id: int) -> None:
        """Before the first kernel projection: the (cached) self-check; on failure, the torch path."""
        if self._self_checked:
            return
        owner = type(self).__name__
        reason = selfcheck.checked_once(owner, self._device, self._check_label(), lambda: self._self_check(model_id))
        self._self_checked = True
        if reason is None:
            return
        if self.requested_backend == "kernel":
            raise CudaBackendError(f"{owner}: backend='kernel' failed its self-check: {reason}")
        self.backend = "torch"
        self.fallback_reason = f"failed its self-check ({reason})"

    def _stream(self) -> int:
        return torch.cuda.current_stream(self._device).cuda_stream

    def _finish(self, out: Tensor) -> Tensor:
        return out if self.dtype == torch.float32 else out.to(self.dtype)


class CudaDenseProjector(_GpuProjectorBase):
    """The dense Rademacher/normal projection of trak_core (``DenseProjector``) on the GPU.

    Arguments as ``DenseProjector``; extra ones:

    * ``algo``: ``"fma"`` (float32 on CUDA cores), ``"tc3"`` (tensor cores, x split into three bf16 terms:
      float32 accuracy), ``"tc2"``/``"tc1"`` (two/one bf16 terms: faster, ~1e-5 / ~4e-3 relative error per
      input), ``"auto"`` (tc3 for Rademacher on sm_80+, else fma). Normal matrices use fma.
    * ``backend``: ``"auto"``, ``"kernel"``, ``"torch"`` or ``"cpu"`` (see the module's docstring).
    * ``max_partial_bytes``: bound of the split-K partial sums (larger batches are cut into chunks).
    * ``group_cols``: dict inputs are concatenated on the GPU in groups of consecutive parameters of at most
      this many coordinates (one kernel call per group; a larger parameter is its own group).
    """

    kind = "dense"
    _cpu_target = "trak_core's CPU DenseProjector"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cuda",
        dtype: torch.dtype = torch.float32,
        algo: str = "auto",
        backend: str = "auto",
        max_partial_bytes: int = 256 * 2**20,
        group_cols: int = 1 << 23,
        model_id: int = 0,
        *args,
        **kwargs,
    ) -> None:
        if algo not in ALGOS:
            raise BadInputError(f"algo must be one of {ALGOS}, got {algo!r}")
        super().__init__(grad_dim, proj_dim, seed, proj_type, device, dtype, backend, model_id)
        if algo.startswith("tc") and self.proj_type != ProjectionType.rademacher:
            raise BadInputError(
                f"algo={algo!r} (tensor cores) exists for Rademacher matrices only; "
                "use algo='fma' or 'auto' for proj_type='normal'"
            )
        self.max_partial_bytes = int(max_partial_bytes)
        self.group_cols = int(group_cols)
        self._cpu: DenseProjector | None = None
        self.algo = algo
        if self.backend == "cpu":
            cpu_kwargs = {k: v for k, v in kwargs.items() if k in ("block_rows", "cache_bytes")}
            self._cpu = DenseProjector(
                grad_dim, proj_dim, seed, self.proj_type, "cpu", dtype=dtype, model_id=model_id, **cpu_kwargs
            )
        elif self.backend == "kernel":
            with torch.cuda.device(self._device):
                cc = int(_build.load_extension().device_cc())
            if cc < 0:
                raise RuntimeError(f"CudaDenseProjector: cannot query the device (CUDA error {-cc})")
            self.compute_capability = cc
            if algo == "auto":
                self.algo = "tc3" if (self.proj_type == ProjectionType.rademacher and cc >= 80) else "fma"
            elif algo.startswith("tc") and cc < 80:
                raise BadInputError(f"algo={algo!r} needs tensor cores with bf16 (sm_80+); this GPU is sm_{cc}")

    def _keys(self, model_id: int) -> tuple[int, int]:
        if self.proj_type == ProjectionType.rademacher:
            return counter_rng.stream_key(self.seed, model_id, counter_rng.STREAM_SIGN_WORDS), 0
        return (
            counter_rng.stream_key(self.seed, model_id, counter_rng.STREAM_NORMAL_U1),
            counter_rng.stream_key(self.seed, model_id, counter_rng.STREAM_NORMAL_U2),
        )

    def _groups(self, pieces: list[Tensor]):
        group, width = [], 0
        for p in pieces:
            w = p.shape[1]
            if group and width + w > self.group_cols:
                yield group, width
                group, width = [], 0
            group.append(p)
            width += w
        if group:
            yield group, width

    def project(self, grads: dict | Tensor, model_id: int) -> Tensor:
        self._check_input(grads)
        if self.backend == "cpu":
            return self._cpu.project(grads, model_id)
        if self.backend == "kernel":
            self._ensure_checked(model_id)  # may switch to the torch path
        pieces = _pieces(grads)
        batch = pieces[0].shape[0]
        out = torch.zeros(batch, self.proj_dim, dtype=torch.float32, device=self._device)
        if batch == 0:
            return self._finish(out)
        if self.backend == "torch":
            kind = self.proj_type.value
            offset = 0
            for p in pieces:
                if p.shape[1]:
                    torch_path.dense_project(
                        p.to(self._device), kind, self.seed, model_id, self.proj_dim, row0=offset, out=out
                    )
                offset += p.shape[1]
            return self._finish(out)
        return self._finish(self._kernel_project(pieces, model_id, out))

    def _kernel_project(self, pieces: list[Tensor], model_id: int, out: Tensor) -> Tensor:
        """``out += concat(pieces) @ R`` with the CUDA kernel (out: (B, proj_dim) float32 on the device)."""
        ext = _build.load_extension()
        key_a, key_b = self._keys(model_id)
        with torch.cuda.device(self._device):
            stream = self._stream()
            offset = 0
            for group, width in self._groups(pieces):
                if width == 0:
                    continue
                parts = [_as_kernel_input(p, self._device) for p in group if p.shape[1] > 0]
                x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
                ext.dense_project(
                    x,
                    out,
                    offset,
                    key_a,
                    key_b,
                    _KIND_CODE[self.proj_type],
                    _ALGO_CODE[self.algo],
                    _build.KSPLIT,
                    self.max_partial_bytes,
                    stream,
                )
                offset += width
        return out

    def _check_label(self) -> str:
        return f"algo={self.algo}, {self.proj_type.value}"

    def _self_check(self, model_id: int) -> str | None:
        kind = self.proj_type.value
        # integer inputs make ±1 sums exact in any order; normal entries are not integers: float probe only
        probes = selfcheck.make_probes(
            self._device, selfcheck.TOLERANCE[self.algo], exact=self.proj_type == ProjectionType.rademacher
        )

        def candidate(x: Tensor) -> Tensor:
            out = torch.zeros(x.shape[0], self.proj_dim, dtype=torch.float32, device=self._device)
            return self._kernel_project([x], model_id, out)

        def reference(x: Tensor) -> Tensor:
            return torch_path.dense_project(x, kind, self.seed, model_id, self.proj_dim, dtype=torch.float64)

        return selfcheck.self_check(candidate, reference, probes)

    def generate(self, model_id: int, row0: int, row1: int) -> Tensor:
        """Rows [row0, row1) of the matrix, generated on this projector's device (float32)."""
        if self.backend == "kernel":
            ext = _build.load_extension()
            key_a, key_b = self._keys(model_id)
            out = torch.empty(row1 - row0, self.proj_dim, dtype=torch.float32, device=self._device)
            with torch.cuda.device(self._device):
                ext.dense_block(row0, out, key_a, key_b, _KIND_CODE[self.proj_type], self._stream())
            return out
        return torch_path.dense_block(
            self.proj_type.value, self.seed, model_id, row0, row1, self.proj_dim, self._device
        )


def _cpu_sjlt_class():
    """trak_core's CPU SJLT projector (trak_core/projection/sjlt.py), or None where this checkout lacks it."""
    try:
        from trak_core.projection.sjlt import SJLTProjector
    except ImportError:
        return None
    return SJLTProjector


class _ReferenceSJLTProjector(AbstractProjector):
    """The SJLT definition on the CPU (used only where trak_core has no SJLTProjector)."""

    kind = "sjlt"

    def __init__(self, grad_dim, proj_dim, seed, proj_type, device="cpu", c=4, dtype=torch.float32, **kwargs):
        super().__init__(grad_dim, proj_dim, seed, proj_type, device)
        self.c, self.dtype = c, dtype

    def project(self, grads, model_id):
        self._check_input(grads)
        x = _flat_on(grads, torch.device("cpu"))
        out = torch_path.sjlt_reference(x, self.seed, model_id, self.proj_dim, self.c, dtype=torch.float32)
        return out.to(self.dtype)


class CudaSJLTProjector(_GpuProjectorBase):
    """The sparse JL projection of trak_core (``SJLTProjector``, ``c`` nonzeros ±√(proj_dim/c) per input
    coordinate) on the GPU.

    Kernel backend: the CSR of the transposed sign matrix is built once per model_id on the GPU (torch
    ops: hash, stable sort by column) and cached; each batch is flattened and transposed on the GPU, then
    one warp per (output column, batch tile) sums its coordinates in a fixed order (no atomics).
    Memory: the plan takes 8·c·grad_dim bytes; the transposed batch B·grad_dim elements.
    """

    kind = "sjlt"
    _cpu_target = "trak_core's CPU SJLTProjector"

    def __init__(
        self,
        grad_dim: int,
        proj_dim: int,
        seed: int = 0,
        proj_type: str | ProjectionType = ProjectionType.rademacher,
        device="cuda",
        c: int = 4,
        dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        model_id: int = 0,
        *args,
        **kwargs,
    ) -> None:
        if as_proj_type(proj_type) != ProjectionType.rademacher:
            raise BadInputError(
                f"SJLT entries are signs ±√(proj_dim/c); proj_type {as_proj_type(proj_type).value!r} "
                "is not defined for it (use 'rademacher')"
            )
        if not isinstance(c, int) or isinstance(c, bool) or c <= 0 or c > proj_dim:
            raise BadInputError(
                f"SJLT: c (nonzeros per input coordinate) must be an integer in [1, proj_dim], got {c!r}"
            )
        super().__init__(grad_dim, proj_dim, seed, proj_type, device, dtype, backend, model_id)
        self.c = c
        self.value_scale = math.sqrt(proj_dim / c)
        self._plan: tuple[int, Tensor, Tensor] | None = None
        self._cpu = None
        if self.backend == "cpu":
            cls = _cpu_sjlt_class() or _ReferenceSJLTProjector
            cpu_kwargs = {k: v for k, v in kwargs.items() if k in ("block_rows", "cache_bytes")}
            self._cpu = cls(grad_dim, proj_dim, seed, self.proj_type, "cpu", c=c, dtype=dtype, **cpu_kwargs)

    def spec(self) -> dict:
        return {**super().spec(), "c": int(self.c)}

    def free_memory(self) -> None:
        self._plan = None
        if self._cpu is not None:
            self._cpu.free_memory()

    def plan(self, model_id: int) -> tuple[Tensor, Tensor]:
        """(col_ptr, packed) of ``model_id`` on this projector's device (cached for the last model_id)."""
        if self._plan is None or self._plan[0] != model_id:
            self._plan = None
            col_ptr, packed = torch_path.sjlt_plan(
                self.seed, model_id, self.grad_dim, self.proj_dim, self.c, self._device
            )
            self._plan = (model_id, col_ptr, packed)
        return self._plan[1], self._plan[2]

    def project(self, grads: dict | Tensor, model_id: int) -> Tensor:
        self._check_input(grads)
        if self.backend == "cpu":
            return self._cpu.project(grads, model_id)
        if self.backend == "kernel":
            self._ensure_checked(model_id)  # may switch to the torch path
        x = _flat_on(grads, self._device)
        batch = x.shape[0]
        if batch == 0:
            return self._finish(torch.zeros(0, self.proj_dim, device=self._device))
        if self.backend == "torch":
            out = torch_path.sjlt_project(x, self.seed, model_id, self.proj_dim, self.c)
            return self._finish(out * self.value_scale)
        col_ptr, packed = self.plan(model_id)
        return self._finish(self._kernel_gather(x, col_ptr, packed))

    def _kernel_gather(self, x: Tensor, col_ptr: Tensor, packed: Tensor) -> Tensor:
        """``value_scale · SJLT(x)`` with the CUDA gather kernel over the CSR plan (x: (B, K) on the device)."""
        ext = _build.load_extension()
        batch = x.shape[0]
        bt = 1
        while bt < min(batch, 32):
            bt *= 2
        out = torch.empty(batch, self.proj_dim, dtype=torch.float32, device=self._device)
        with torch.cuda.device(self._device):
            xt = x.t().contiguous()
            ext.sjlt_project(xt, col_ptr, packed, out, self.value_scale, bt, self._stream())
        return out

    def _check_label(self) -> str:
        return "gather"

    def _self_check(self, model_id: int) -> str | None:
        probes = selfcheck.make_probes(self._device, selfcheck.TOLERANCE["sjlt"], exact=True)
        width = probes[0].x.shape[1]
        col_ptr, packed = torch_path.sjlt_plan(self.seed, model_id, width, self.proj_dim, self.c, self._device)

        def candidate(x: Tensor) -> Tensor:
            return self._kernel_gather(x, col_ptr, packed)

        def reference(x: Tensor) -> Tensor:
            return torch_path.sjlt_reference(x, self.seed, model_id, self.proj_dim, self.c, dtype=torch.float64)

        return selfcheck.self_check(candidate, reference, probes)


def make_cuda_projector(
    kind: str, grad_dim: int, proj_dim: int, seed: int = 0, proj_type="rademacher", device="cuda", **kwargs
) -> AbstractProjector:
    """A GPU projector by kind: ``"dense"``, ``"sjlt"`` or ``"fast_jl"`` (TRAK's CUDA projector, if installed)."""
    if isinstance(kind, Enum):
        kind = kind.value
    if kind == "dense":
        return CudaDenseProjector(grad_dim, proj_dim, seed, proj_type, device, **kwargs)
    if kind == "sjlt":
        return CudaSJLTProjector(grad_dim, proj_dim, seed, proj_type, device, **kwargs)
    if kind == "fast_jl":
        from .fast_jl_interop import FastJLProjector

        return FastJLProjector(grad_dim, proj_dim, seed, proj_type, device, **kwargs)
    raise BadInputError(f"unknown GPU projector {kind!r}; choose 'dense', 'sjlt' or 'fast_jl'")


def CudaProjector(
    grad_dim: int, proj_dim: int, seed: int = 0, proj_type="rademacher", device="cuda", kind: str = "dense", **kwargs
) -> AbstractProjector:
    """``CudaProjector(..., kind="dense" | "sjlt" | "fast_jl")``: one entry point for the GPU projectors."""
    return make_cuda_projector(kind, grad_dim, proj_dim, seed, proj_type, device, **kwargs)


def _make_fast_jl(grad_dim: int, proj_dim: int, seed: int = 0, proj_type="rademacher", device="cuda", **kwargs):
    from .fast_jl_interop import FastJLProjector

    return FastJLProjector(grad_dim, proj_dim, seed, proj_type, device, **kwargs)


def register_projectors() -> None:
    """Register the GPU projectors in trak_core's registry (done when cuda_ext is imported; idempotent):
    ``"dense"`` and ``"sjlt"`` on CUDA devices, ``"fast_jl"`` on any device (it refuses non-CUDA devices
    with a message that says what to use instead)."""
    register_projector("dense", CudaDenseProjector, devices=("cuda",))
    register_projector("sjlt", CudaSJLTProjector, devices=("cuda",))
    register_projector("fast_jl", _make_fast_jl)
