"""`prompt_embeds` payloads: tensors written by real torch.save (torch is a test dependency only)
decode to the same values without torch, and payloads that are not a plain tensor are refused
without running anything."""

from __future__ import annotations

import base64
import io
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxserve.errors import InvalidRequestError
from jaxserve.server.tensor_codec import as_prompt_embeds, decode_base64_tensor, decode_torch_tensor

PARAM = "prompt_embeds"


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def as_float32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy()


def rezip(data: bytes, replace: dict[str, bytes]) -> bytes:
    """A torch.save archive with some records replaced (suffix match on the name)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            new = next((v for k, v in replace.items() if name.endswith(k)), None)
            dst.writestr(name, src.read(name) if new is None else new)
    return out.getvalue()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(5, 8), (1, 5, 8)])
def test_contiguous_tensors_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    array = decode_torch_tensor(saved(tensor), PARAM)
    assert array.shape == shape
    assert array.dtype == {torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}.get(
        dtype, np.dtype(str(dtype).removeprefix("torch."))
    )
    np.testing.assert_array_equal(array.astype(np.float32), as_float32(tensor))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_keep_their_offset_and_strides(dtype: torch.dtype) -> None:
    base = torch.arange(96, dtype=torch.float32).reshape(8, 12).to(dtype)
    for view in (base.t(), base[2:7, 3:11], base.t()[1:, ::2], base[1]):
        assert not view.is_contiguous() or view.storage_offset() > 0
        array = decode_torch_tensor(saved(view), PARAM)
        assert array.flags.c_contiguous and array.flags.writeable
        np.testing.assert_array_equal(array.astype(np.float32), as_float32(view))


def test_float8_uses_rebuild_tensor_v3() -> None:
    tensor = torch.linspace(-4, 4, 24).reshape(3, 8).to(torch.float8_e4m3fn)
    array = decode_torch_tensor(saved(tensor), PARAM)
    assert array.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(array.astype(np.float32), as_float32(tensor))


def test_parameter_and_empty_tensor() -> None:
    param = torch.nn.Parameter(torch.ones(2, 3))
    np.testing.assert_array_equal(decode_torch_tensor(saved(param), PARAM), np.ones((2, 3), np.float32))
    assert decode_torch_tensor(saved(torch.zeros(0, 8)), PARAM).shape == (0, 8)


def test_big_endian_archive() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    data = saved(tensor)
    swapped = tensor.numpy().astype(">f4").tobytes()
    array = decode_torch_tensor(rezip(data, {"/byteorder": b"big", "/data/0": swapped}), PARAM)
    np.testing.assert_array_equal(array, tensor.numpy())


def test_base64_as_vllm_clients_send_it() -> None:
    tensor = torch.randn(4, 16)
    text = base64.b64encode(saved(tensor)).decode()
    np.testing.assert_array_equal(decode_base64_tensor(text, PARAM, 1 << 20), tensor.numpy())


def test_npy() -> None:
    array = np.arange(40, dtype=np.float16).reshape(5, 8)
    for arr in (array, np.asfortranarray(array), array.astype(">f4")):
        buffer = io.BytesIO()
        np.save(buffer, arr)
        out = decode_torch_tensor(buffer.getvalue(), PARAM)
        np.testing.assert_array_equal(out, arr)
        assert out.dtype.isnative
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidRequestError, match="not a number type"):  # would need pickle
        decode_torch_tensor(buffer.getvalue(), PARAM)
    buffer = io.BytesIO()
    np.save(buffer, array)
    with pytest.raises(InvalidRequestError, match=r"data is not \(5, 8\)"):  # truncated
        decode_torch_tensor(buffer.getvalue()[:-2], PARAM)


def malicious_archives(marker: Path) -> list[bytes]:
    """torch.save-shaped zips whose data.pkl would touch `marker` if unpickled by plain pickle."""
    command = f"touch {marker}"
    evil = [
        # os.system(command) as the whole payload.
        b"cos\nsystem\n(" + pickle.dumps(command, protocol=0)[:-1] + b"tR.",
        # builtins.eval, via STACK_GLOBAL (protocol 4) the way newer pickles name globals.
        pickle.dumps(_Eval(f"__import__('os').system({command!r})"), protocol=4),
        # A real tensor pickle with its storage class swapped for os.system.
        _tensor_pickle().replace(b"ctorch\nFloatStorage\n", b"cos\nsystem\n"),
        # A real tensor pickle with a BUILD setting state on the result.
        _tensor_pickle()[:-1] + b"}X\x05\x00\x00\x00arrayNsb.",
    ]
    return [rezip(saved(torch.ones(2, 2)), {"/data.pkl": pkl}) for pkl in evil]


class _Eval:
    def __init__(self, source: str) -> None:
        self.source = source

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return eval, (self.source,)


def _tensor_pickle() -> bytes:
    with zipfile.ZipFile(io.BytesIO(saved(torch.ones(2, 2)))) as archive:
        return archive.read("archive/data.pkl")


def test_malicious_pickles_are_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    archives = malicious_archives(marker)
    # The payloads are live: plain pickle would run the first one.
    with zipfile.ZipFile(io.BytesIO(archives[0])) as archive:
        assert b"system" in archive.read("archive/data.pkl")
    reasons = ["global os.system is not allowed", "global builtins.eval is not allowed",
               "global os.system is not allowed", "BUILD on a tensor object is not allowed"]
    for data, reason in zip(archives, reasons, strict=True):
        with pytest.raises(InvalidRequestError, match=reason) as info:
            decode_torch_tensor(data, PARAM)
        assert info.value.param == PARAM
    assert not marker.exists()


def test_payloads_that_are_not_one_plain_tensor() -> None:
    with zipfile.ZipFile(io.BytesIO(saved(torch.ones(16)[3:]))) as archive:
        pkl = archive.read("archive/data.pkl")
    assert pkl.count(b"K\x03K\r\x85") == 1  # storage offset 3, size (13,)
    past_the_end = pkl.replace(b"K\x03K\r\x85", b"K\x05K\r\x85")  # offset 5: elements 5..17 of 16
    cases = {
        "not a single tensor": saved({"a": torch.ones(2)}),  # type: ignore[arg-type]
        "broadcast": saved(torch.ones(8).expand(5, 8)),
        "shorter than 16 elements": rezip(saved(torch.ones(4, 4)), {"/data/0": b"\0" * 32}),
        "reads past its storage": rezip(saved(torch.ones(16)[3:]), {"/data.pkl": past_the_end}),
        "no single": b"PK\x05\x06" + b"\0" * 18,  # an empty zip
        "could not be decoded": b"not a tensor at all",
    }
    for reason, data in cases.items():
        with pytest.raises(InvalidRequestError, match=reason):
            decode_torch_tensor(data, PARAM)


def test_zip_bomb_entry_is_refused() -> None:
    data = saved(torch.ones(2, 2))
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, b"\0" * 10_000_000 if name.endswith("/data/0") else src.read(name))
    with pytest.raises(InvalidRequestError, match="larger than the archive"):
        decode_torch_tensor(out.getvalue(), PARAM)


def test_base64_errors_and_limit() -> None:
    text = base64.b64encode(saved(torch.ones(64, 64))).decode()
    with pytest.raises(InvalidRequestError, match="not valid base64"):
        decode_base64_tensor(text[:-3] + "!!!", PARAM, 1 << 20)
    with pytest.raises(InvalidRequestError, match="not valid base64"):
        decode_base64_tensor("é" + text, PARAM, 1 << 20)
    size = len(base64.b64decode(text))
    with pytest.raises(InvalidRequestError, match=f"limit of {size - 1} bytes"):
        decode_base64_tensor(text, PARAM, size - 1)
    with pytest.raises(InvalidRequestError, match="limit of 1000 bytes"):
        decode_base64_tensor(text, PARAM, 1000)  # refused before decoding
    assert decode_base64_tensor(text, PARAM, size).shape == (64, 64)


def test_prompt_embeds_shape_rules() -> None:
    x = np.zeros((5, 8), np.float32)
    assert as_prompt_embeds(x, PARAM, 8).shape == (5, 8)
    assert as_prompt_embeds(x[None], PARAM, 8).shape == (5, 8)
    assert as_prompt_embeds(x.astype(ml_dtypes.bfloat16), PARAM, 8).dtype == ml_dtypes.bfloat16
    for bad, reason in [
        (np.zeros((2, 5, 8), np.float32), "2D tensor"),
        (np.zeros((1, 1, 5, 8), np.float32), "2D tensor"),
        (np.zeros(8, np.float32), "2D tensor"),
        (np.zeros((5, 7), np.float32), "hidden size 7"),
        (np.zeros((0, 8), np.float32), "at least one token"),
        (np.zeros((5, 8), np.int64), "not a floating-point"),
    ]:
        with pytest.raises(InvalidRequestError, match=reason):
            as_prompt_embeds(bad, PARAM, 8)
