"""Images in requests, as vLLM and SGLang accept them: data URLs, bare base64, local files and
http(s) URLs, each gated by a `MediaPolicy` the operator sets. Every refusal is an
`InvalidRequestError` that names the parameter and the limit, never a 500: the bytes are untrusted,
so sizes are checked before decoding and every decoder error is caught here."""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import os
import re
import stat
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

from PIL import Image, ImageOps

from jaxserve.errors import InvalidRequestError

# Pillow's names; MPO is how Pillow labels many camera JPEGs (a JPEG with extra pictures after it).
FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})
MAX_REDIRECTS = 5
_CHUNK = 64 * 1024
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# Decoders of untrusted bytes fail in many ways; each of these is the client's fault, not ours.
_DECODE_ERRORS = (OSError, ValueError, EOFError, SyntaxError, struct.error, IndexError, KeyError,
                  Image.DecompressionBombWarning)


@dataclass(frozen=True)
class MediaPolicy:
    """What the operator lets requests load. The defaults take only inline images (data URLs and
    base64): reading the server's files or fetching URLs on a client's behalf must be switched on."""

    allowed_local_media_path: Path | None = None  # local files only under here; None: refused
    allow_remote_media: bool = False
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 20 * 1024 * 1024  # encoded size: base64 payload, file or URL body
    fetch_timeout_s: float = 10.0
    max_images: int = 16  # per request (--limit-mm-per-prompt, vLLM's flag)


def check_count(n: int, policy: MediaPolicy, param: str = "image_url") -> None:
    """Refuse a request with more images than the policy allows (before loading any)."""
    if n > policy.max_images:
        raise InvalidRequestError(param, f"request has {n} images, over the limit of {policy.max_images} "
                                  "(--limit-mm-per-prompt)")


def load_image(spec: str, policy: MediaPolicy, param: str = "image_url") -> Image.Image:
    """The image `spec` names, decoded and fully loaded as RGB (the first frame of an animation)."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidRequestError(param, "must be a non-empty string (a data: URL, an http(s) URL, "
                                         "a local path or base64 image data)")
    return _decode(_read_bytes(spec.strip(), policy, param), policy, param)


def image_hash(image: Image.Image) -> str:
    """SHA-256 of the decoded pixels and size: identical pixels share it whatever their encoding,
    so the prefix cache can key an image's tokens by it."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256(f"RGB {rgb.width}x{rgb.height}\0".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def _read_bytes(spec: str, policy: MediaPolicy, param: str) -> bytes:
    lower = spec[:16].lower()
    if lower.startswith("data:"):
        return _from_data_url(spec, policy, param)
    if lower.startswith(("http://", "https://")):
        return _fetch(spec, policy, param)
    if lower.startswith("file:"):
        return _read_local(_file_url_path(spec, param), policy, param)
    if _URL_SCHEME.match(spec):
        scheme = spec.split(":", 1)[0]
        raise InvalidRequestError(param, f"URL scheme {scheme!r} is not supported; send a data: URL, "
                                         "an http(s) URL, a file:// URL or base64 image data")
    compact = "".join(spec.split())  # base64 is often wrapped into lines
    # A path with an extension has a '.', which base64 never has, so base64 is tried first.
    if len(compact) % 4 == 0 and _BASE64.fullmatch(compact):
        return _b64decode(compact, policy, param)
    if "/" in spec or os.sep in spec or "." in spec:  # SGLang passes file names
        return _read_local(spec, policy, param)
    raise InvalidRequestError(param, "is not a data: URL, an http(s) URL, a local path or base64 image data")


def _from_data_url(spec: str, policy: MediaPolicy, param: str) -> bytes:
    header, comma, payload = spec.partition(",")
    if not comma:
        raise InvalidRequestError(param, "data URL has no ',' before its data")
    media_type, *options = header[len("data:"):].split(";")
    if not media_type.lower().startswith("image/"):
        raise InvalidRequestError(param, f"data URL type {media_type!r} is not an image type (image/...)")
    if "base64" not in (o.strip().lower() for o in options):
        raise InvalidRequestError(param, "data URLs must be base64 (data:image/png;base64,...)")
    return _b64decode("".join(payload.split()), policy, param)


def _b64decode(text: str, policy: MediaPolicy, param: str) -> bytes:
    # Refuse from the length alone, before allocating the decoded bytes.
    size = len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))
    _check_size(size, policy, param)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(param, f"invalid base64 image data: {e}") from None


def _check_size(size: int, policy: MediaPolicy, param: str) -> None:
    if size > policy.max_image_bytes:
        raise InvalidRequestError(param, f"image is {size} bytes, over --max-image-bytes {policy.max_image_bytes}")


def _file_url_path(url: str, param: str) -> str:
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise InvalidRequestError(param, "file URLs must name an absolute local path (file:///abs/path)")
    return path


def _read_local(path_text: str, policy: MediaPolicy, param: str) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(param, "local files are off; start the server with --allowed-local-media-path DIR")
    try:
        # resolve() follows every symlink and '..', so the containment check sees the real file;
        # relative names are taken under the allowed directory.
        root = Path(root).resolve()
        path = (root / path_text).resolve()
        if not path.is_relative_to(root):
            raise InvalidRequestError(param, f"local image {path_text!r} is outside --allowed-local-media-path")
        # Checked before open(): opening a FIFO or device could block or never end.
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequestError(param, f"local image {path_text!r} is not a regular file")
        _check_size(info.st_size, policy, param)
        with open(path, "rb") as f:
            return _read_limited(f, policy, param)
    except InvalidRequestError:
        raise
    except FileNotFoundError:
        raise InvalidRequestError(param, f"local image {path_text!r} does not exist") from None
    except (OSError, RuntimeError, ValueError) as e:  # permissions, symlink loops, NUL bytes
        raise InvalidRequestError(param, f"cannot read local image {path_text!r}: {e}") from None


def _read_limited(stream, policy: MediaPolicy, param: str, deadline: float | None = None) -> bytes:
    """The stream's bytes, refused as soon as they pass the byte limit or the deadline: a body's
    declared length may lie, and a server can trickle bytes under the socket's per-read timeout."""
    read = getattr(stream, "read1", stream.read)  # read1 returns what has arrived, so the deadline is seen
    chunks, total = [], 0
    while chunk := read(_CHUNK):
        total += len(chunk)
        if total > policy.max_image_bytes:
            raise InvalidRequestError(param, f"image is over --max-image-bytes {policy.max_image_bytes} bytes")
        if deadline is not None and time.monotonic() > deadline:
            raise _timeout(policy, param)
        chunks.append(chunk)
    return b"".join(chunks)


def _timeout(policy: MediaPolicy, param: str) -> InvalidRequestError:
    return InvalidRequestError(param, f"fetching the image took longer than the {policy.fetch_timeout_s:g} s "
                                      "timeout (--media-fetch-timeout)")


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows up to MAX_REDIRECTS redirects, only to http(s): a client's URL must not turn into
    a read of the server's own files (file:) or another protocol."""

    max_repeats = MAX_REDIRECTS + 1  # our own count below decides

    def __init__(self, param: str):
        self.param = param

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers.get("location") or headers.get("uri")
        if location is not None:
            scheme = urlsplit(urljoin(req.full_url, location.strip())).scheme.lower()
            if scheme not in ("http", "https"):
                fp.close()
                raise InvalidRequestError(self.param, f"image URL redirects to a {scheme or '?'}: URL; "
                                                      "only http(s) redirects are followed")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        new.hops = getattr(req, "hops", 0) + 1
        if new.hops > MAX_REDIRECTS:
            fp.close()
            raise InvalidRequestError(self.param, f"image URL redirects more than {MAX_REDIRECTS} times")
        return new


def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    if not policy.allow_remote_media:
        raise InvalidRequestError(param, "remote images are off; start the server with --allow-remote-media")
    deadline = time.monotonic() + policy.fetch_timeout_s
    opener = urllib.request.build_opener(_HttpOnlyRedirects(param))
    request = urllib.request.Request(url, headers={"User-Agent": "jaxserve"})
    try:
        with opener.open(request, timeout=policy.fetch_timeout_s) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit():
                _check_size(int(length), policy, param)
            return _read_limited(response, policy, param, deadline)
    except InvalidRequestError:
        raise
    except urllib.error.HTTPError as e:
        e.close()
        raise InvalidRequestError(param, f"image URL returned HTTP status {e.code} {e.reason}") from None
    except TimeoutError:
        raise _timeout(policy, param) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _timeout(policy, param) from None
        raise InvalidRequestError(param, f"fetching the image failed: {e.reason}") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise InvalidRequestError(param, f"fetching the image failed: {e!r}") from None


def _decode(data: bytes, policy: MediaPolicy, param: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:  # lazy: reads the header only
            if image.format not in FORMATS:
                raise InvalidRequestError(param, f"image format {image.format} is not accepted; "
                                                 "send PNG, JPEG, WebP, GIF or BMP")
            _check_pixels(image.size, policy, param)
            # What HF's load_image does (then its processors' convert_to_rgb, a no-op on RGB), so the
            # pixels the model sees are HF's: EXIF rotation applied, alpha dropped, not composited.
            return ImageOps.exif_transpose(image).convert("RGB")
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own limit, checked inside open()
        raise InvalidRequestError(param, f"image is too large: {e} (--max-image-pixels "
                                         f"{policy.max_image_pixels})") from None
    except _DECODE_ERRORS as e:
        raise InvalidRequestError(param, f"corrupt or unsupported image: {e}") from None


def _check_pixels(size: tuple[int, int], policy: MediaPolicy, param: str) -> None:
    width, height = size
    if width * height > policy.max_image_pixels:
        raise InvalidRequestError(param, f"image is {width}x{height} = {width * height} pixels, "
                                         f"over --max-image-pixels {policy.max_image_pixels}")
