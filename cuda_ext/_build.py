"""Building and loading the CUDA extension at first use (torch.utils.cpp_extension.load + ninja).

``load_extension()`` returns the compiled module, or None; ``unavailable_reason()`` then says why in one
line (no CUDA in this torch build, no visible device, no nvcc, no ninja, the compiler's first error...).
The attempt is made once per process; ``TRAKFLOW_CUDA_EXT=0`` disables the kernels (the projectors then use
the pure-torch GPU path), ``TRAKFLOW_CUDA_EXT_BUILD_DIR`` chooses where the build goes (default: torch's
extension cache, ``~/.cache/torch_extensions``), ``TRAKFLOW_CUDA_EXT_VERBOSE=1`` shows the compiler's output.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SOURCES = ("binding.cpp", "kernels.cu")
HEADERS = ("kernels.h", "counter_hash.h")
KSPLIT = 32768  # TRAK_KSPLIT of kernels.h: rows per split of the dense kernels

_lock = threading.Lock()
_state: dict = {"tried": False, "ext": None, "reason": None, "built": None}


def source_digest() -> str:
    """A short hash of the kernel sources (part of the module's name: a changed source is a new build)."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    return h.hexdigest()[:12]


def cuda_unavailable_reason() -> str | None:
    """Why torch cannot run CUDA kernels here, or None when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def _short(err: BaseException) -> str:
    """The most telling line of a build error (the first compiler 'error' line, else the first line)."""
    text = str(err) or type(err).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if re.search(r"\berror\b", ln, re.IGNORECASE) and "Error building extension" not in ln:
            return ln[:300]
    return (lines[0] if lines else type(err).__name__)[:300]


def _build_dir() -> str | None:
    path = os.environ.get("TRAKFLOW_CUDA_EXT_BUILD_DIR")
    if not path:
        return None
    os.makedirs(path, exist_ok=True)
    return path


def load_extension(force: bool = False, verbose: bool | None = None):
    """The compiled kernels (a Python module), or None when they cannot be had (see unavailable_reason)."""
    with _lock:
        if _state["tried"] and not force:
            return _state["ext"]
        _state.update(tried=True, ext=None, reason=None)
        if os.environ.get("TRAKFLOW_CUDA_EXT", "1") == "0":
            _state["reason"] = "the CUDA kernels are disabled (TRAKFLOW_CUDA_EXT=0)"
            return None
        reason = cuda_unavailable_reason()
        if reason is not None:
            _state["reason"] = reason
            return None
        try:
            from torch.utils import cpp_extension
        except Exception as e:  # pragma: no cover - torch without its extension builder
            _state["reason"] = f"torch.utils.cpp_extension is unavailable: {_short(e)}"
            return None
        if cpp_extension.CUDA_HOME is None:
            _state["reason"] = "the CUDA toolkit (nvcc) was not found; set CUDA_HOME"
            return None
        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            _state["reason"] = "ninja is not installed (pip install ninja)"
            return None
        if verbose is None:
            verbose = os.environ.get("TRAKFLOW_CUDA_EXT_VERBOSE", "0") == "1"
        if _state.get("built") is not None:  # built earlier in this process (a forced retry reuses it)
            _state["ext"] = _state["built"]
            return _state["ext"]
        try:
            ext = cpp_extension.load(
                name=f"trakflow_cuda_ext_{source_digest()}",
                sources=[str(HERE / s) for s in SOURCES],
                extra_include_paths=[str(HERE)],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                build_directory=_build_dir(),
                verbose=verbose,
            )
        except Exception as e:  # the compiler's or the loader's error, reported in one line
            _state["reason"] = f"building the CUDA kernels failed: {_short(e)}"
            return None
        if int(ext.ksplit_rows()) != KSPLIT:  # pragma: no cover - kernels.h and this file disagree
            _state["reason"] = f"kernels.h has TRAK_KSPLIT={ext.ksplit_rows()}, _build.py {KSPLIT}"
            return None
        _state["ext"] = _state["built"] = ext
        return ext


def unavailable_reason() -> str | None:
    """Why load_extension() returned None (None before the first attempt or after a success)."""
    return _state["reason"]


def is_available() -> bool:
    return load_extension() is not None
