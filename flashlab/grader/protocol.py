"""The wire between the batch grader and a submission's sandbox: plain arrays, never pickle.

The trusted grader listens on a Unix socket that only one submission's sandbox can
reach.  Inside that sandbox, the notebook's own ``grade("name", fn)`` call connects,
names the exercise, then for each case the grader drew it receives the case's
params and input arrays, runs ``fn`` on them locally and sends the outputs back.
The grader compares them with its own reference and keeps the verdict; the
notebook only learns that its answer was collected.  With ``--leaderboard`` a
passing kernel is then timed over the same connection ("time", "ready", "go",
checksums back: :mod:`flashlab.grader.ranking`), on the grader's clock.

A frame is a 4-byte big-endian length, a UTF-8 JSON header of that length, then
the raw bytes of the arrays the header lists (``{"dtype": "<f8", "shape": [..]}``
each).  Only numeric and boolean dtypes are accepted, every size is capped and
every read has a deadline, so a hostile peer can send nothing but data.

Values are JSON with arrays replaced by ``{"__array__": i}``; a torch tensor is
sent as an array of a NumPy dtype plus ``"torch": "<dtype>"`` (bfloat16 travels as
float32, which holds every bfloat16 exactly) and rebuilt as that tensor.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import time

import numpy as np

SOCKET_ENV = "FLASHLAB_BATCH_SOCKET"

MAX_HEADER = 1 << 20            # bytes of JSON per frame
MAX_ARRAY = 256 << 20           # bytes per array
MAX_TOTAL = 512 << 20           # bytes of arrays per frame
MAX_ARRAYS = 256
MAX_NDIM = 8
DTYPES = {np.dtype(t).str: np.dtype(t) for t in
          ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64")}
_ARRAY, _TORCH = "__array__", "torch"


class ProtocolError(Exception):
    """The peer broke the protocol (bad frame, size over a cap, a type that is not allowed)."""


class PeerTimeout(ProtocolError):
    """The peer did not send a whole frame before the deadline."""


# ----------------------------------------------------------------------------
# values <-> (JSON tree, arrays)
# ----------------------------------------------------------------------------

def pack(value, arrays: list):
    """A JSON-able tree for ``value``; arrays and tensors go to ``arrays``."""
    if isinstance(value, np.ndarray):
        arrays.append(_plain(value))
        return {_ARRAY: len(arrays) - 1}
    if type(value).__module__ == "torch" and type(value).__name__ == "Tensor":
        import torch
        t = value.detach().cpu()
        name = str(t.dtype).replace("torch.", "")
        if t.dtype == torch.bfloat16:
            t = t.float()           # exact: every bfloat16 is a float32
        arrays.append(_plain(t.numpy()))
        return {_ARRAY: len(arrays) - 1, _TORCH: name}
    if isinstance(value, np.generic):
        return pack(np.asarray(value), arrays)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [pack(v, arrays) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or _ARRAY in value:
            raise TypeError("dict keys must be strings (and not '__array__')")
        return {k: pack(v, arrays) for k, v in value.items()}
    raise TypeError(f"cannot send a {type(value).__name__}: only arrays, tensors, numbers, strings, "
                    f"lists and dicts travel")


def _plain(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    if a.dtype.str not in DTYPES:
        a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.kind in "biuf" else a
    if a.dtype.str not in DTYPES:
        raise TypeError(f"arrays of dtype {a.dtype} cannot be sent (numbers and booleans only)")
    return a


def unpack(tree, arrays: list, *, torch_ok: bool = False, device=None, depth: int = 0):
    """The value that :func:`pack` made ``tree`` from.  Tensors are rebuilt only where
    ``torch_ok`` (the sandbox side); the grader accepts plain arrays only."""
    if depth > 16:
        raise ProtocolError("value nested too deeply")
    if isinstance(tree, dict):
        if _ARRAY in tree:
            i = tree[_ARRAY]
            if type(i) is not int or not 0 <= i < len(arrays) or set(tree) - {_ARRAY, _TORCH}:
                raise ProtocolError("bad array reference")
            if _TORCH in tree:
                if not torch_ok:
                    raise ProtocolError("tensors are not accepted here: send NumPy arrays")
                import torch
                dtype = getattr(torch, str(tree[_TORCH]), None)
                if not isinstance(dtype, torch.dtype):
                    raise ProtocolError(f"unknown tensor dtype {tree[_TORCH]!r}")
                return torch.from_numpy(arrays[i].copy()).to(dtype=dtype, device=device)
            return arrays[i]
        return {str(k): unpack(v, arrays, torch_ok=torch_ok, device=device, depth=depth + 1)
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [unpack(v, arrays, torch_ok=torch_ok, device=device, depth=depth + 1) for v in tree]
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise ProtocolError(f"unexpected value of type {type(tree).__name__}")


# ----------------------------------------------------------------------------
# frames
# ----------------------------------------------------------------------------

def send(sock: socket.socket, header: dict, arrays=(), timeout: float = 60.0) -> None:
    arrays = [_plain(a) for a in arrays]
    header = dict(header, arrays=[{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays])
    head = json.dumps(header).encode()
    if len(head) > MAX_HEADER:
        raise ProtocolError(f"header of {len(head)} bytes is over the {MAX_HEADER} limit")
    sock.settimeout(timeout)
    sock.sendall(struct.pack(">I", len(head)) + head)
    for a in arrays:
        if a.size:
            sock.sendall(a.tobytes())


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout("the other side stopped sending")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise PeerTimeout("the other side stopped sending") from None
        if k == 0:
            raise ProtocolError("connection closed in the middle of a frame" if got else "connection closed")
        got += k
    return bytes(buf)


def recv(sock: socket.socket, deadline: float, *, max_total: int = MAX_TOTAL):
    """One frame: (header dict, list of arrays).  Raises ProtocolError on anything unexpected."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > MAX_HEADER:
        raise ProtocolError(f"header of {n} bytes is over the {MAX_HEADER} limit")
    try:
        header = json.loads(_recv_exact(sock, n, deadline).decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays", []), list):
        raise ProtocolError("header is not a JSON object with an 'arrays' list")
    specs = header.pop("arrays", [])
    if len(specs) > MAX_ARRAYS:
        raise ProtocolError(f"{len(specs)} arrays in one frame (at most {MAX_ARRAYS})")
    layout, total = [], 0
    for s in specs:
        if not isinstance(s, dict) or s.get("dtype") not in DTYPES or not isinstance(s.get("shape"), list):
            raise ProtocolError(f"bad array description {str(s)[:80]} (numeric dtypes only)")
        shape = s["shape"]
        if len(shape) > MAX_NDIM or not all(type(d) is int and 0 <= d <= MAX_ARRAY for d in shape):
            raise ProtocolError(f"bad array shape {str(shape)[:80]}")
        dtype = DTYPES[s["dtype"]]
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=object))
        total += nbytes
        if nbytes > MAX_ARRAY or total > max_total:
            raise ProtocolError("arrays over the size limit")
        layout.append((dtype, tuple(shape), nbytes))
    arrays = [np.frombuffer(_recv_exact(sock, nb, deadline), dtype=dt).reshape(shape).copy()
              if nb else np.zeros(shape, dt) for dt, shape, nb in layout]
    return header, arrays


# ----------------------------------------------------------------------------
# the sandbox's side of grade()
# ----------------------------------------------------------------------------

class Submitted:
    """What ``grade()`` returns under batch grading: the answer was collected; the verdict is the grader's."""

    def __init__(self, name: str, note: str = ""):
        self.name, self.note = name, note
        self.passed = None

    def __repr__(self) -> str:
        return f"{self.name}: answer collected by the batch grader{(' (' + self.note + ')') if self.note else ''}"

    __str__ = __repr__


def serve_cases(ex, candidate, path: str | None = None, sock: socket.socket | None = None) -> Submitted:
    """Inside a sandbox: connect to the grader, run ``candidate`` on each case it sends, send back
    the outputs.  Runs the candidate exactly as a learner's own ``grade()`` does (a forked child
    for exercises that ask for one)."""
    from .core import Case, local_executor
    from .. import device
    from . import requirements as Rq
    execute = local_executor(ex, candidate)
    if sock is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path or os.environ[SOCKET_ENV])

    def fetch(name, idx):            # a served input's elements, asked for as they are used
        send(sock, {"op": "read", "name": name}, [np.asarray(idx, dtype=np.int64)])
        reply, values = recv(sock, time.monotonic() + 120)
        if reply.get("op") != "values" or len(values) != 1:
            raise RuntimeError(f"the grader did not serve `{name}`: {str(reply.get('message', ''))[:200]}")
        return values[0]

    try:
        send(sock, {"op": "grade", "exercise": ex.name})
        while True:
            header, arrays = recv(sock, time.monotonic() + 3600)
            op = header.get("op")
            if op == "done":
                return Submitted(ex.name, str(header.get("note", "")))
            if op == "time" and getattr(ex, "timing", None) is not None:   # the leaderboard: a passing kernel
                from .ranking import serve_timing
                serve_timing(sock, ex, candidate, header)
                continue
            if op != "case":
                return Submitted(ex.name, f"the grader said: {str(header.get('message', op))[:200]}")
            inputs = unpack(header["inputs"], arrays, torch_ok=True, device=device.DEVICE)
            for name, shape in dict(header.get("served") or {}).items():
                inputs[name] = Rq.served(name, shape, fetch)
            case = Case(header["params"], inputs, bool(header.get("visible")), bool(header.get("large")))
            outcome = execute(header.get("kind", "run"), case)
            reply, out_arrays = {"op": "outcome", "status": outcome.status, "error": outcome.error[:4000]}, []
            try:
                reply["value"] = pack(outcome.value, out_arrays)
            except TypeError as e:
                reply = {"op": "outcome", "status": "error", "error": f"the output cannot be collected: {e}"}
                out_arrays = []
            send(sock, reply, out_arrays)
    finally:
        sock.close()
