"""Where kernels run: a CUDA GPU (compiled Triton) or the CPU (Triton's interpreter).

This module must be imported before any ``@triton.jit`` function is defined:
Triton reads ``TRITON_INTERPRET`` when the decorator runs, so the choice is made
here, once, at import time.  ``flashlab/__init__.py`` imports it first.

    >>> from flashlab import device
    >>> device.DEVICE            # torch.device("cuda") or torch.device("cpu")
    >>> device.INTERPRET         # True when kernels go through the interpreter
    >>> N = device.pick(gpu=4096, cpu=128)   # a size that runs in reasonable time here
"""
from __future__ import annotations

import os
import platform
import sys
import warnings


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard requirement
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver is the same as no GPU for us
        return False


GPU: bool = _cuda_available()

# Respect an explicit choice (TRITON_INTERPRET=1 on a GPU machine is a useful
# debugging mode); otherwise interpret exactly when there is no GPU.
if "TRITON_INTERPRET" not in os.environ and not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        # Triton's own helpers (tl.max, tl.sum, ...) are @triton.jit functions, decorated when
        # triton.language is imported: they are already compiled-mode and fail in the interpreter
        # with "Cannot call @triton.jit'd outside of the scope of a kernel".
        warnings.warn(
            "triton was imported before flashlab, so it is not in interpreter mode and kernels will fail "
            "on this machine (no GPU). Restart the kernel and `import flashlab` before `import triton` "
            "(or set os.environ['TRITON_INTERPRET'] = '1' before importing triton).",
            RuntimeWarning, stacklevel=2)

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")

import torch  # noqa: E402  (after the environment variable is settled)

DEVICE = torch.device("cuda" if GPU and not INTERPRET else "cpu")


def pick(gpu, cpu):
    """Return ``gpu`` on a GPU and ``cpu`` in the interpreter.

    Notebooks keep their sizes in one parameters cell, written with ``pick`` so
    the same notebook runs at full size on a GPU and in minutes on a laptop.
    """
    return cpu if INTERPRET else gpu


def bf16_supported() -> bool:
    """Whether bfloat16 kernels give right answers here.

    On a GPU: compute capability 8.0 or newer.  In the interpreter Triton's bf16
    ``tl.dot`` returns garbage, so flashlab upcasts bf16 to fp32 there: the answer
    is right, but it is not a bf16 computation.
    """
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_capability()[0] >= 8
    return False


# Shared memory one program (thread block) may use, by compute capability, as the CUDA
# programming guide lists it (the "opt-in" maximum).  Used only when the driver cannot be asked.
SHARED_MEMORY_BY_CC = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                       (8, 9): 99 * 1024, (9, 0): 227 * 1024}


def shared_memory_per_block() -> int | None:
    """Bytes of shared memory one Triton program may use on this GPU; None in the interpreter.

    T4 (sm_75) 64 KB, L4 / RTX 4090 (sm_89) 99 KB, A100 (sm_80) 163 KB, H100 / H200 (sm_90)
    227 KB.  Asked of Triton's driver (the number its launcher checks against), else worked
    out from torch's device properties.
    """
    if DEVICE.type != "cuda":
        return None
    idx = torch.cuda.current_device()
    try:
        import triton
        return int(triton.runtime.driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    except Exception:
        props = torch.cuda.get_device_properties(idx)
        cc = (props.major, props.minor)
        if cc in SHARED_MEMORY_BY_CC:
            return SHARED_MEMORY_BY_CC[cc]
        return int(props.shared_memory_per_multiprocessor) - (1024 if props.major >= 8 else 0)


def capability() -> tuple | None:
    """(major, minor) compute capability of the GPU, None in the interpreter."""
    return torch.cuda.get_device_capability() if DEVICE.type == "cuda" else None


def report() -> dict:
    """A dictionary describing this environment (what ``python -m flashlab env`` prints)."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version_of("triton"),
        "numpy": _version_of("numpy"),
        "device": str(DEVICE),
        "interpreter": INTERPRET,
        "gpu": None,
        "compute_capability": None,
        "gpu_memory_gib": None,
        "shared_memory_per_block_kib": None,
        "bf16_kernels": "native" if bf16_supported() else ("upcast to fp32" if INTERPRET else "no"),
        "timings": "yes" if DEVICE.type == "cuda" else "no (interpreter: correct but slow)",
    }
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["compute_capability"] = "%d.%d" % (props.major, props.minor)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["shared_memory_per_block_kib"] = (shared_memory_per_block() or 0) // 1024
    return info


def format_report(info: dict | None = None) -> str:
    info = report() if info is None else info
    width = max(len(k) for k in info)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in info.items())


def print_report() -> None:
    print(format_report())


def _version_of(module: str):
    try:
        return __import__(module).__version__
    except Exception:
        return None

