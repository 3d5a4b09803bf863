"""A compile worker process: builds outlines-core indexes so the server never has to.

Building an index walks regex automaton x vocabulary and can take seconds (or forever, for a
pathological regex). It runs here, in a separate process, so the server can stop it at its time
budget by killing the process, and so it never holds the server's GIL. The protocol over
stdin/stdout is length-prefixed pickles:

    parent -> ("init", {token bytes: [ids]}, eos_id)          once
    parent -> ("regex", pattern, None) | ("json_schema", schema, whitespace regex or None)  per job
    worker -> ("ok", pickled Index, seconds) | ("error", message)

Run as `python -m jaxserve.structured.worker`; it imports neither jax nor the model.
"""

from __future__ import annotations

import pickle
import struct
import sys
import time
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def write_frame(stream: BinaryIO, message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> Any:
    header = _read_exact(stream, _HEADER.size)
    return pickle.loads(_read_exact(stream, _HEADER.unpack(header)[0]))


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def build(vocabulary: Any, kind: str, text: str, whitespace: str | None = None) -> bytes:
    """A pickled outlines-core Index; `whitespace`: a JSON schema's whitespace regex (None: outlines'
    own, an optional space)."""
    from outlines_core import Index
    from outlines_core.json_schema import build_regex_from_schema

    pattern = build_regex_from_schema(text, whitespace_pattern=whitespace) if kind == "json_schema" else text
    return pickle.dumps(Index(pattern, vocabulary), protocol=pickle.HIGHEST_PROTOCOL)


def main() -> None:
    from outlines_core import Vocabulary

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must never corrupt the frame stream
    vocabulary = None
    while True:
        try:
            message = read_frame(stdin)
        except EOFError:
            return
        if message[0] == "init":
            _, tokens, eos_id = message
            vocabulary = Vocabulary(eos_id, tokens)
            write_frame(stdout, ("ok", b"", 0.0))
            continue
        kind, text, whitespace = message
        start = time.perf_counter()
        try:
            if vocabulary is None:
                raise RuntimeError("the worker was not initialised")
            result: tuple = ("ok", build(vocabulary, kind, text, whitespace), time.perf_counter() - start)
        except Exception as e:  # the user's regex/schema: reported, never fatal
            result = ("error", " ".join(str(e).split()) or type(e).__name__)
        write_frame(stdout, result)


if __name__ == "__main__":
    main()
