"""Tensors a client sends in a request body, decoded without torch.

vLLM's completions API takes `prompt_embeds` as base64 of `torch.save(tensor, buffer)`, and loads
it with `torch.load(weights_only=True)`. This module reads that format itself: torch.save writes a
zip holding `<root>/data.pkl` (a pickle that rebuilds the tensor) and one raw little-endian record
`<root>/data/<key>` per storage. The pickle goes through an Unpickler that knows only the handful
of globals a plain tensor names, each mapped to a stand-in here, so a payload naming anything else
(`os.system`, `builtins.eval`, ...) is refused before it can run. NumPy's `.npy` is accepted too.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import ml_dtypes
import numpy as np

from jaxserve.errors import InvalidRequestError

# torch's storage classes (what `_rebuild_tensor_v2` pickles) and the dtype objects
# `_rebuild_tensor_v3` pickles for the dtypes that only have an untyped storage.
_STORAGE_DTYPES: Final[dict[str, np.dtype]] = {
    name: np.dtype(dtype)
    for name, dtype in {
        "DoubleStorage": np.float64,
        "FloatStorage": np.float32,
        "HalfStorage": np.float16,
        "BFloat16Storage": ml_dtypes.bfloat16,
        "LongStorage": np.int64,
        "IntStorage": np.int32,
        "ShortStorage": np.int16,
        "CharStorage": np.int8,
        "ByteStorage": np.uint8,
        "BoolStorage": np.bool_,
        "UntypedStorage": np.uint8,  # torch reads an untyped storage as bytes
    }.items()
}
_TORCH_DTYPES: Final[dict[str, np.dtype]] = {
    name: np.dtype(dtype)
    for name, dtype in {
        "float64": np.float64,
        "float32": np.float32,
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "float8_e5m2": ml_dtypes.float8_e5m2,
        "int64": np.int64,
        "int32": np.int32,
        "int16": np.int16,
        "int8": np.int8,
        "uint8": np.uint8,
        "uint16": np.uint16,
        "uint32": np.uint32,
        "uint64": np.uint64,
        "bool": np.bool_,
    }.items()
}
# What `prompt_embeds` may hold: vLLM accepts any floating-point tensor and casts it to the
# model's dtype. np.issubdtype does not know ml_dtypes' types, hence the explicit set.
FLOAT_DTYPES: Final = frozenset(
    np.dtype(d)
    for d in (
        np.float64,
        np.float32,
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
    )
)
_NPY_MAGIC: Final = b"\x93NUMPY"
# The reason a decoder gives is built from the client's bytes: repeat only this much of it.
_MAX_REASON_CHARS: Final = 200


class _Opaque:
    """Base of every object the pickle can reach. pickle's BUILD opcode calls `__setstate__` (or
    rewrites `__dict__`) on any object it holds; refusing it keeps a payload from rewriting our
    stand-ins, or numpy's shared dtype objects, which is why none of those is handed out bare."""

    __slots__ = ()

    def __setstate__(self, state: object) -> None:
        raise pickle.UnpicklingError("BUILD on a tensor object is not allowed")


class _Marker(_Opaque):
    """A storage class or dtype named by the pickle: just the numpy dtype it stands for."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype


class _Call(_Opaque):
    """An allowed callable (a rebuild function, OrderedDict), callable by REDUCE only."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> object:
        return self.fn(*args)


class _Storage(_Opaque):
    """One storage record: its raw bytes and the dtype the pickle gave it."""

    __slots__ = ("raw", "dtype")

    def __init__(self, raw: bytes, dtype: np.dtype) -> None:
        self.raw, self.dtype = raw, dtype


class _Tensor(_Opaque):
    """A rebuilt tensor. Only our rebuild functions make one, so the pickle's result is a tensor
    exactly when it is one of these."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _view(storage: object, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
          dtype: np.dtype | None = None) -> _Tensor:
    """torch's `Tensor.set_(storage, offset, size, stride)`, bounds-checked, as a copy."""
    if not isinstance(storage, _Storage):
        raise ValueError("a tensor's storage is not a storage record")
    dtype = storage.dtype if dtype is None else dtype
    size, stride = tuple(size), tuple(stride)
    ints = (offset, *size, *stride)
    if len(size) != len(stride) or not all(isinstance(v, int) and v >= 0 for v in ints):
        raise ValueError("a tensor's offset, size and stride must be non-negative integers")
    if len(storage.raw) % dtype.itemsize:
        raise ValueError("a storage record is not a whole number of elements")
    flat = np.frombuffer(storage.raw, dtype=dtype)
    if 0 in size:
        return _Tensor(np.zeros(size, dtype))
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= flat.size:
        raise ValueError(f"a tensor reads past its storage ({last} >= {flat.size} elements)")
    # Only a view repeating elements (expand's stride 0, overlapping strides) has more elements
    # than its storage; accepting one would let a few bytes expand into an arbitrarily large array.
    if math.prod(size) > flat.size:
        raise ValueError("broadcast tensors (more elements than their storage) are not accepted: "
                         "save tensor.contiguous()")
    strides = tuple(s * dtype.itemsize for s in stride)
    view = np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=strides)
    return _Tensor(np.array(view, order="C"))  # a copy: C-contiguous, writable, its own memory


def _rebuild_tensor(storage: object, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...], *_rest: object) -> _Tensor:
    # `_rebuild_tensor_v2`'s requires_grad, hooks and metadata mean nothing here.
    return _view(storage, offset, size, stride)


def _rebuild_tensor_v3(storage: object, offset: int, size: tuple[int, ...],
                       stride: tuple[int, ...], _requires_grad: object, _hooks: object,
                       dtype: object, *_rest: object) -> _Tensor:
    # v3 pairs an untyped (byte) storage with the tensor's dtype, used for float8 and the like.
    if not isinstance(dtype, _Marker):
        raise ValueError("a tensor's dtype is not a torch dtype")
    return _view(storage, offset, size, stride, dtype.dtype)


def _rebuild_parameter(data: object, *_rest: object) -> _Tensor:
    # torch.save of an nn.Parameter: the tensor inside it, as torch.load(weights_only) gives it.
    if not isinstance(data, _Tensor):
        raise ValueError("a parameter does not wrap a tensor")
    return data


_GLOBALS: Final[dict[tuple[str, str], _Opaque]] = {
    ("torch._utils", "_rebuild_tensor"): _Call(_rebuild_tensor),
    ("torch._utils", "_rebuild_tensor_v2"): _Call(_rebuild_tensor),
    ("torch._utils", "_rebuild_tensor_v3"): _Call(_rebuild_tensor_v3),
    ("torch._utils", "_rebuild_parameter"): _Call(_rebuild_parameter),
    ("collections", "OrderedDict"): _Call(OrderedDict),  # the (empty) backward hooks
    **{("torch", name): _Marker(dtype) for name, dtype in _STORAGE_DTYPES.items()},
    ("torch.storage", "UntypedStorage"): _Marker(_STORAGE_DTYPES["UntypedStorage"]),  # v3's
    **{("torch", name): _Marker(dtype) for name, dtype in _TORCH_DTYPES.items()},
}


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles torch.save's data.pkl with nothing but the globals in _GLOBALS."""

    def __init__(self, archive: zipfile.ZipFile, root: str, byteorder: str, limit: int) -> None:
        super().__init__(io.BytesIO(_read(archive, f"{root}/data.pkl", limit)))
        self.archive, self.root, self.byteorder, self.limit = archive, root, byteorder, limit
        self.storages: dict[tuple[str, np.dtype], _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor")
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        # torch.save's id: ("storage", storage class, key, location, number of elements).
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unknown persistent id")
        _, kind, key, _location, numel = pid
        if not (isinstance(kind, _Marker) and isinstance(key, str) and isinstance(numel, int)):
            raise pickle.UnpicklingError("malformed storage id")
        if (key, kind.dtype) not in self.storages:
            nbytes = numel * kind.dtype.itemsize
            raw = _read(self.archive, f"{self.root}/data/{key}", self.limit)
            if numel < 0 or len(raw) < nbytes:
                raise pickle.UnpicklingError(f"storage {key!r} is shorter than {numel} elements")
            raw = raw[:nbytes]
            if self.byteorder == "big" and kind.dtype.itemsize > 1:
                # Records hold the saving machine's byte order; swap through a same-width uint.
                unsigned = np.frombuffer(raw, dtype=f"u{kind.dtype.itemsize}")
                raw = unsigned.byteswap().tobytes()
            self.storages[key, kind.dtype] = _Storage(raw, kind.dtype)
        return self.storages[key, kind.dtype]


def _read(archive: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """Entry `name`, refused when larger than `limit` (the archive's own size): torch.save stores
    its records uncompressed, so a larger one can only be a compressed zip bomb."""
    info = archive.getinfo(name)
    if info.file_size > limit:
        raise ValueError(f"zip entry {name!r} is larger than the archive")
    return archive.read(info)


def _decode_torch_zip(data: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        # torch names every record `<root>/...`, root being the saved file's stem ("archive").
        roots = [n[: -len("/data.pkl")] for n in archive.namelist()
                 if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(roots) != 1:
            raise ValueError("not a torch.save archive (no single <root>/data.pkl)")
        root = roots[0]
        byteorder = "little"  # what torch assumes when the record is missing (old versions)
        if f"{root}/byteorder" in archive.namelist():
            byteorder = _read(archive, f"{root}/byteorder", len(data)).decode("ascii", "replace").strip()
            if byteorder not in ("little", "big"):
                raise ValueError(f"unknown byteorder {byteorder[:20]!r}")
        result = _TensorUnpickler(archive, root, byteorder, len(data)).load()
    if not isinstance(result, _Tensor):
        raise ValueError(f"the payload holds a {type(result).__name__}, not a single tensor")
    return result.array


def _decode_npy(data: bytes) -> np.ndarray:
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise ValueError(f".npy version {version} is not supported")
    if dtype.kind not in "biuf":  # no object (pickled) or structured arrays
        raise ValueError(f".npy dtype {dtype} is not a number type")
    # Checked before reading so a header claiming a huge shape allocates nothing.
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - stream.tell():
        raise ValueError(f".npy data is not {shape} of {dtype}")
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return flat.reshape(shape, order="F" if fortran else "C").astype(dtype.newbyteorder("="))


def _reason(exc: Exception) -> str:
    reason = str(exc).strip() or type(exc).__name__
    if len(reason) > _MAX_REASON_CHARS:
        reason = f"{reason[:_MAX_REASON_CHARS]}... ({len(reason) - _MAX_REASON_CHARS} more)"
    return reason


def decode_torch_tensor(data: bytes, param: str) -> np.ndarray:
    """The array in `data`, which is torch.save's zip format (or a .npy file). Raises
    InvalidRequestError naming `param` for anything else, including a pickle naming any global a
    plain tensor does not need."""
    try:
        if data.startswith(_NPY_MAGIC):
            return _decode_npy(data)
        return _decode_torch_zip(data)
    except MemoryError:
        raise  # the server's condition, not the request's
    except Exception as exc:  # zipfile, pickle and numpy each raise their own kinds
        raise InvalidRequestError(
            param, f"could not be decoded as a torch.save tensor or .npy array: {_reason(exc)}"
        ) from exc


def decode_base64_tensor(text: str, param: str, max_bytes: int) -> np.ndarray:
    """decode_torch_tensor of base64 `text`, refused past `max_bytes` decoded bytes."""
    # Checked before decoding, so an oversized body costs no decoded copy (4 chars per 3 bytes).
    if len(text) > 4 * -(-max_bytes // 3):
        raise InvalidRequestError(param, f"is larger than the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(param, f"is not valid base64: {_reason(exc)}") from exc
    if len(data) > max_bytes:
        raise InvalidRequestError(param, f"is larger than the limit of {max_bytes} bytes")
    return decode_torch_tensor(data, param)


def as_prompt_embeds(array: np.ndarray, param: str, hidden_size: int) -> np.ndarray:
    """vLLM's shape rules for `prompt_embeds` (vllm/renderers/embed_utils.py): a tensor of more
    than two dimensions loses a leading dimension of size 1, the result must be
    (num_tokens, hidden_size), and any floating-point dtype is accepted (the caller casts it to
    the model's dtype). Unlike vLLM, no tokens at all is refused here rather than downstream."""
    if array.ndim > 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2:
        raise InvalidRequestError(
            param, f"must be a 2D tensor of shape (num_tokens, hidden_size); got {array.shape}"
        )
    if array.shape[1] != hidden_size:
        raise InvalidRequestError(
            param, f"hidden size {array.shape[1]} does not match the model's {hidden_size}"
        )
    if array.shape[0] == 0:
        raise InvalidRequestError(param, "must hold at least one token")
    if array.dtype not in FLOAT_DTYPES:
        raise InvalidRequestError(param, f"dtype {array.dtype} is not a floating-point type")
    return array
