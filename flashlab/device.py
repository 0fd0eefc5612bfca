"""Where kernels run: a CUDA GPU (compiled Triton) or the CPU (Triton's interpreter).

This module must be imported before any ``@triton.jit`` function is defined:
Triton reads ``TRITON_INTERPRET`` when the decorator runs, so the choice is made
here, once, at import time.  ``flashlab/__init__.py`` imports it first.

    >>> from flashlab import device
    >>> device.DEVICE            # torch.device("cuda") or torch.device("cpu")
    >>> device.INTERPRET         # True when kernels go through the interpreter
    >>> N = device.pick(gpu=4096, cpu=128)   # a size that runs in reasonable time here
    >>> device.TRITON            # False where Triton is not installed (macOS, Windows)
"""
from __future__ import annotations

import functools
import importlib.util
import os
import platform
import sys
import warnings


def _check_not_namespace_package() -> None:
    """Refuse the namespace-package trap with a message that says what happened and what to do.

    Python started in the folder that *contains* the clone (``~/`` for ``~/flashlab``) finds the
    repository folder itself under the name ``flashlab``: a folder without ``__init__.py``, which
    Python imports as an empty namespace package (``flashlab.__file__`` is None).  An editable install
    still serves ``flashlab.device`` and friends, so the failure would come later and make no sense.
    """
    pkg = sys.modules.get(__package__ or "flashlab")
    if pkg is not None and getattr(pkg, "__file__", None) is None:
        where = list(getattr(pkg, "__path__", []))
        raise ImportError(
            f"`import flashlab` found the folder {where[0] if where else '?'} instead of the package: Python "
            "was started in the folder that contains the flashlab repository, so the repository folder itself "
            "shadows the package (an empty namespace package). Start Python or Jupyter inside the repository "
            "(cd flashlab), or anywhere else but its parent folder.")


_check_not_namespace_package()


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

# Triton publishes wheels for Linux only: on macOS and Windows requirements.txt skips it, and the
# NumPy parts of the course (notebooks 00-03 and their exercises) run without it.
TRITON: bool = importlib.util.find_spec("triton") is not None

# Respect an explicit choice (TRITON_INTERPRET=1 on a GPU machine is a useful
# debugging mode); otherwise interpret exactly when there is no GPU.
if "TRITON_INTERPRET" not in os.environ and not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    if sys.modules.get("triton") is not None:
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


class TritonMissing(ImportError):
    """Raised by the parts of the course that need Triton when it is not installed."""


def missing_triton_message(what: str = "This part of the course") -> str:
    from .colab import REPO_URL
    return (f"{what} needs Triton, which is not installed here. Triton publishes wheels for Linux "
            f"only, so on macOS and Windows `pip install -r requirements.txt` leaves it out. The NumPy "
            f"notebooks 00-03 and their exercises run without it; for the Triton parts, open the notebook "
            f"in Colab (the 'Open in Colab' badge at its top; choose Runtime > Change runtime type > GPU), "
            f"or use Linux (WSL2 on Windows). Repository: {REPO_URL}")


def require_triton(what: str = "This part of the course") -> None:
    """Raise :class:`TritonMissing` with a message saying what is missing and offering Colab."""
    if not TRITON:
        raise TritonMissing(missing_triton_message(what))


def register_magics() -> None:
    """In IPython/Jupyter, register the ``%%needs_triton`` cell magic; elsewhere do nothing."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is not None:
        ip.register_magic_function(_needs_triton_magic, magic_kind="cell", magic_name="needs_triton")


def _needs_triton_magic(line, cell):
    """``%%needs_triton``: run the cell if Triton is installed; otherwise say what is missing and skip it.

    Keeps "Run All" going on a laptop without Triton.  The cell runs in the notebook's namespace,
    compiled under a name IPython caches, so ``@triton.jit`` can read the kernel's source.
    """
    if not TRITON:
        print(missing_triton_message("This cell") + "\n(cell skipped)")
        return
    from IPython import get_ipython
    ip = get_ipython()
    code = ip.transform_cell(cell)
    name = ip.compile.cache(code)
    exec(ip.compile(code, name, "exec"), ip.user_global_ns, ip.user_ns)


def bf16_supported() -> bool:
    """Whether bfloat16 kernels give right answers here.

    On a GPU: compute capability 8.0 or newer (A100, L4, H100; not the T4, which has fp16 only).
    ``torch.cuda.is_bf16_supported()`` says True on a T4 too, because PyTorch *emulates* bf16
    there; Triton's bf16 ``tl.dot`` needs the hardware.  In the interpreter Triton's bf16
    ``tl.dot`` returns garbage, so flashlab upcasts bf16 to fp32 there: the answer
    is right, but it is not a bf16 computation.
    """
    if DEVICE.type == "cuda":
        return capability()[0] >= 8
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
    return _shared_memory_of(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _shared_memory_of(idx: int) -> int:
    """The driver query behind :func:`shared_memory_per_block`, asked once per GPU (launchers call it often)."""
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
    """(major, minor) compute capability of the current GPU, None in the interpreter."""
    return _capability_of(torch.cuda.current_device()) if DEVICE.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _capability_of(idx: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(idx))


def report() -> dict:
    """A dictionary describing this environment (what ``python -m flashlab env`` prints)."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version_of("triton") if TRITON else "not installed: the NumPy notebooks 00-03 run; "
                                                       "for the Triton parts use Colab or Linux",
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
    if not TRITON:  # no kernels at all: say so instead of describing kernels that cannot run
        info.update(interpreter="n/a (no Triton)", bf16_kernels="n/a (no Triton)",
                    timings="PyTorch only (no Triton)" if DEVICE.type == "cuda" else "no")
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

