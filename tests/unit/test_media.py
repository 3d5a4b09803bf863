"""Image inputs: every way a request may name an image (data URL, bare base64, local file, http
URL), the operator's gates on each, and the limits, against real encoders and a real HTTP server."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import pytest
from PIL import Image

from jaxserve.errors import InvalidRequestError
from jaxserve.multimodal.media import MediaPolicy, check_count, image_hash, load_image

RED, BLUE = (255, 0, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def picture() -> Image.Image:
    """A small image with distinct pixels, so a wrong decode or a transposition shows."""
    image = Image.new("RGB", (6, 4))
    image.putdata([(i * 40 % 256, i * 7 % 256, 255 - i * 9) for i in range(24)])
    return image


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def refused(spec: str, policy: MediaPolicy = MediaPolicy(), param: str = "image_url") -> str:
    with pytest.raises(InvalidRequestError) as info:
        load_image(spec, policy, param)
    assert info.value.param == param
    return str(info.value)


def test_data_urls_and_bare_base64_load_as_rgb():
    png = encode(picture(), "PNG")
    image = load_image(data_url(png), MediaPolicy())
    assert image.mode == "RGB" and image.size == (6, 4)
    assert image.tobytes() == picture().tobytes()
    assert load_image(base64.b64encode(png).decode(), MediaPolicy()).tobytes() == picture().tobytes()
    # A JPEG's base64 starts with '/9j/', like a path: it is still read as base64.
    jpeg = base64.b64encode(encode(picture(), "JPEG")).decode()
    assert jpeg.startswith("/9j/") and load_image(jpeg, MediaPolicy()).size == (6, 4)
    wrapped = "\n".join(jpeg[i:i + 76] for i in range(0, len(jpeg), 76))  # MIME line breaks
    assert load_image(wrapped, MediaPolicy()).size == (6, 4)
    bmp = load_image(data_url(encode(picture(), "BMP"), "bmp"), MediaPolicy())
    assert bmp.tobytes() == picture().tobytes()


def test_equal_pixels_share_a_hash_across_encodings():
    png = load_image(data_url(encode(picture(), "PNG")), MediaPolicy())
    webp = load_image(data_url(encode(picture(), "WEBP", lossless=True), "webp"), MediaPolicy())
    assert image_hash(png) == image_hash(webp)
    other = picture()
    other.putpixel((0, 0), (1, 2, 3))
    assert image_hash(other) != image_hash(png)
    # Same bytes, other shape: the size is part of the key.
    assert image_hash(png) != image_hash(Image.frombytes("RGB", (4, 6), png.tobytes()))


def test_animations_give_their_first_frame():
    frames = [Image.new("RGB", (8, 8), RED), Image.new("RGB", (8, 8), BLUE)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    assert load_image(data_url(gif, "gif"), MediaPolicy()).getpixel((3, 3)) == RED
    webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    assert load_image(data_url(webp, "webp"), MediaPolicy()).getpixel((3, 3)) == RED


def test_transparency_is_dropped_as_hf_does_not_composited():
    rgba = Image.new("RGBA", (2, 2), (10, 20, 30, 0))  # fully transparent, yet its colour is kept
    loaded = load_image(data_url(encode(rgba, "PNG")), MediaPolicy())
    assert loaded.mode == "RGB" and loaded.getpixel((0, 0)) == (10, 20, 30)
    palette = Image.new("P", (2, 2), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)
    png = encode(palette, "PNG", transparency=1)
    hf = Image.open(io.BytesIO(png)).convert("RGB")  # transformers' load_image / convert_to_rgb
    assert load_image(data_url(png), MediaPolicy()).tobytes() == hf.tobytes()
    assert hf.getpixel((0, 0)) == (200, 100, 50)


def test_exif_orientation_is_applied_as_hf_does():
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    jpeg = encode(Image.new("RGB", (8, 4), RED), "JPEG", exif=exif.tobytes())
    assert load_image(data_url(jpeg, "jpeg"), MediaPolicy()).size == (4, 8)


def test_local_files_are_refused_unless_under_the_allowed_directory(tmp_path):
    media, png = tmp_path / "media", encode(picture(), "PNG")
    media.mkdir()
    (media / "cat.png").write_bytes(png)
    (tmp_path / "secret.png").write_bytes(png)
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    assert "local files are off; start the server with --allowed-local-media-path DIR" in refused(
        str(media / "cat.png"), param="image_data")
    allowed = MediaPolicy(allowed_local_media_path=media)
    for spec in (str(media / "cat.png"), f"file://{media}/cat.png", "cat.png"):
        assert load_image(spec, allowed).tobytes() == picture().tobytes()
    for spec in (str(tmp_path / "secret.png"), f"{media}/../secret.png", "../secret.png",
                 str(media / "link.png"), f"file://{media}/link.png"):
        assert "is outside --allowed-local-media-path" in refused(spec, allowed)
    assert "does not exist" in refused(str(media / "dog.png"), allowed)
    assert "not a regular file" in refused(str(media), allowed)
    assert "absolute local path" in refused("file://otherhost/etc/passwd", allowed)


class _Handler(http.server.BaseHTTPRequestHandler):
    PNG = encode(picture(), "PNG")
    protocol_version = "HTTP/1.0"  # close-delimited bodies, so a body may come without a length

    def do_GET(self):  # noqa: N802 (http.server's name)
        route = {"/cat.png": self.image, "/hop": lambda: self.redirect("/cat.png"),
                 "/to-file": lambda: self.redirect("file:///etc/passwd"), "/loop": lambda: self.redirect("/loop"),
                 "/big": lambda: self.body(b"x" * 5000, sized=True), "/big-unsized": lambda: self.body(b"x" * 5000),
                 "/slow": self.slow, "/trickle": self.trickle}.get(self.path)
        if route is None:
            self.send_error(404)
        else:
            route()

    def image(self):
        self.body(self.PNG, sized=True)

    def body(self, data: bytes, sized: bool = False):
        self.send_response(200)
        if sized:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def redirect(self, location: str):
        self.send_response(302)
        self.send_header("Location", location)
        self.end_headers()

    def slow(self):
        time.sleep(1.0)
        self.image()

    def trickle(self):  # each read arrives in time, the whole body (10 s) does not
        self.send_response(200)
        self.end_headers()
        for _ in range(200):
            self.wfile.write(b"x" * 10)
            self.wfile.flush()
            time.sleep(0.05)

    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads, block_on_close = True, False

    def handle_error(self, request, client_address):
        pass  # the client hanging up on a slow endpoint is the point of those tests


@pytest.fixture(scope="module")
def server():
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_remote_images_are_refused_by_default(server):
    assert "remote images are off; start the server with --allow-remote-media" in refused(f"{server}/cat.png")


def test_remote_images_load_and_follow_http_redirects(server):
    remote = MediaPolicy(allow_remote_media=True)
    assert load_image(f"{server}/cat.png", remote).tobytes() == picture().tobytes()
    assert load_image(f"{server}/hop", remote).tobytes() == picture().tobytes()


def test_remote_failures_name_the_cause(server):
    remote = MediaPolicy(allow_remote_media=True)
    assert "HTTP status 404" in refused(f"{server}/missing", remote)
    assert "redirects to a file: URL" in refused(f"{server}/to-file", remote)
    assert "redirects more than 5 times" in refused(f"{server}/loop", remote)
    small = MediaPolicy(allow_remote_media=True, max_image_bytes=1000)
    assert "over --max-image-bytes 1000" in refused(f"{server}/big", small)
    assert "over --max-image-bytes 1000" in refused(f"{server}/big-unsized", small)
    hasty = MediaPolicy(allow_remote_media=True, fetch_timeout_s=0.3)
    assert "longer than the 0.3 s timeout" in refused(f"{server}/slow", hasty)
    start = time.monotonic()
    assert "longer than the 0.3 s timeout" in refused(f"{server}/trickle", hasty)
    # The whole fetch has a deadline, not just each read: it ends long before the 10 s body (with
    # room for a busy machine; the deadline is 0.3 s).
    assert time.monotonic() - start < 5
    assert "fetching the image failed" in refused("http://127.0.0.1:1/cat.png", remote)


def test_other_url_schemes_are_refused():
    assert "scheme 'ftp' is not supported" in refused("ftp://example.com/cat.png")


def test_corrupt_and_unsupported_images_are_refused():
    assert "corrupt or unsupported image" in refused(data_url(b"not an image at all"))
    assert "corrupt or unsupported image" in refused(data_url(encode(picture(), "PNG")[:60]))  # truncated
    assert "image format TIFF is not accepted" in refused(data_url(encode(picture(), "TIFF"), "tiff"))
    assert "invalid base64" in refused("data:image/png;base64,abc")
    assert "must be base64" in refused("data:image/png,%89PNG")
    assert "not an image type" in refused("data:text/plain;base64,aGVsbG8=")
    assert "is not a data: URL" in refused("hello world")
    assert "non-empty string" in refused("  ")


def test_pixel_limits_are_checked_from_the_header():
    huge = encode(Image.new("1", (5000, 5000)), "PNG")  # a few KB that decode to 25M pixels
    assert len(huge) < 100_000
    message = refused(data_url(huge), param="image_data")
    assert "image is 5000x5000 = 25000000 pixels, over --max-image-pixels 16777216" in message
    small = MediaPolicy(max_image_pixels=100)
    assert "20x20 = 400 pixels, over --max-image-pixels 100" in refused(
        data_url(encode(Image.new("RGB", (20, 20)), "PNG")), small)
    assert load_image(data_url(encode(Image.new("RGB", (10, 10)), "PNG")), small).size == (10, 10)


def test_byte_and_count_limits():
    png = encode(picture(), "PNG")
    tight = MediaPolicy(max_image_bytes=len(png) - 1)
    assert f"over --max-image-bytes {len(png) - 1}" in refused(data_url(png), tight)
    assert f"over --max-image-bytes {len(png) - 1}" in refused(base64.b64encode(png).decode(), tight)
    assert load_image(data_url(png), MediaPolicy(max_image_bytes=len(png))).size == (6, 4)
    check_count(16, MediaPolicy())
    with pytest.raises(InvalidRequestError, match=r"17 images, over the limit of 16 \(--limit-mm-per-prompt\)") as info:
        check_count(17, MediaPolicy(), "messages")
    assert info.value.param == "messages"
