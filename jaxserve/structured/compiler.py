"""GrammarCompiler: GuideSpec -> Grammar, off the event loop and off the engine thread, within a
time and size budget, remembered in a bounded LRU.

- outlines-core indexes are built in worker processes (`worker.py`); a build that outlives
  `timeout_s` has its process killed (a thread could not be stopped) and the request gets a 400.
  An index larger than `max_index_bytes` is refused the same way.
- llguidance grammars need no build step (their lexer is built lazily while masks are computed),
  only a validation, which runs in the compiler's threads.
- Results are cached in memory by hash(kind, spec, vocabulary), bounded by entries and bytes;
  concurrent requests for the same spec share one compilation.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import pickle
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any

from jaxserve.structured import spec as specs
from jaxserve.structured.matcher import Grammar, LLGuidanceGrammar, OutlinesGrammar
from jaxserve.structured.spec import GuideError, GuideSpec
from jaxserve.structured.vocabulary import TokenVocabulary
from jaxserve.structured.worker import read_frame, write_frame

log = logging.getLogger("jaxserve.structured")

_JSON_OBJECT_SCHEMA = '{"type": "object"}'


class _Worker:
    """One compile process; one job at a time."""

    def __init__(self, init: tuple, start_timeout: float = 120.0):
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # never let a child grab an accelerator
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.structured.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, bufsize=0, env=env)
        self.run(init, start_timeout)

    def run(self, job: tuple, timeout: float) -> tuple:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        write_frame(self.proc.stdin, job)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            raise TimeoutError
        return read_frame(self.proc.stdout)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarCompiler:
    def __init__(
        self,
        vocabulary: TokenVocabulary,
        hf_tokenizer: Any,
        *,
        timeout_s: float = 30.0,
        max_index_bytes: int = 256 << 20,
        cache_entries: int = 256,
        cache_bytes: int = 1 << 30,
        workers: int = 2,
    ):
        self.vocabulary = vocabulary
        self.hf_tokenizer = hf_tokenizer
        self.timeout_s = timeout_s
        self.max_index_bytes = max_index_bytes
        self.cache_entries = cache_entries
        self.cache_bytes = cache_bytes
        self.num_workers = workers
        self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []  # idle ones
        self._num_started = 0
        self._worker_free = threading.Condition(self._lock)
        self._executor = concurrent.futures.ThreadPoolExecutor(max(workers, 1), thread_name_prefix="jaxserve-grammar")
        self._ll_tokenizer: Any = None
        self._closed = False
        self.stats = collections.Counter()  # hits, misses, compiled, errors, timeouts

    # ---- public -------------------------------------------------------------------------------
    def cached(self, spec: GuideSpec) -> Grammar | None:
        with self._lock:
            return self._lookup(spec.cache_key(self.vocabulary.fingerprint))

    def _lookup(self, key: str) -> Grammar | None:
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            self.stats["hits"] += 1
        return grammar

    def get(self, spec: GuideSpec) -> Grammar:
        """The compiled grammar (blocking; thread-safe). Raises GuideError for anything the user
        can fix: invalid or unsupported specs, over-budget compiles."""
        key = spec.cache_key(self.vocabulary.fingerprint)
        with self._lock:
            grammar = self._lookup(key)
            if grammar is not None:
                return grammar
            future = self._inflight.get(key)
            owner = future is None
            if owner:
                future = self._inflight[key] = concurrent.futures.Future()
                self.stats["misses"] += 1
        if not owner:
            return future.result()
        try:
            start = time.perf_counter()
            grammar = self._compile(spec)
            log.info("compiled %s constraint in %.3fs (%d KiB)", spec.kind, time.perf_counter() - start,
                     grammar.nbytes >> 10)
        except BaseException as e:
            self.stats["errors"] += 1
            with self._lock:
                del self._inflight[key]
            future.set_exception(e)
            raise
        with self._lock:
            del self._inflight[key]
            self._insert(key, grammar)
        future.set_result(grammar)
        return grammar

    async def get_async(self, spec: GuideSpec) -> Grammar:
        """`get` for the event loop: cache hits answer at once, compiles run in the compiler's
        threads, so requests wait for their own compile without blocking anyone else."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        return await asyncio.wrap_future(self._executor.submit(self.get, spec))

    def warm_up(self) -> None:
        """Start the worker processes and the llguidance tokenizer now rather than on the first
        constrained request."""
        self._ll()
        with self._lock:
            while self._num_started < self.num_workers:
                self._num_started += 1
                self._workers.append(self._start_worker())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for w in workers:
            w.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- compiling -----------------------------------------------------------------------------
    def _compile(self, spec: GuideSpec) -> Grammar:
        if spec.kind == "regex":
            return self._outlines("regex", spec.text, spec)
        if spec.kind == "choice":
            return self._outlines("regex", specs.choice_regex(json.loads(spec.text)), spec)
        if spec.kind == "json_schema":
            if specs.outlines_honours(json.loads(spec.text)):
                return self._outlines("json_schema", spec.text, spec)
            schema = json.dumps(specs.close_objects(json.loads(spec.text)))
            return self._llguidance(self._ll_json(schema, spec.whitespace), spec)
        if spec.kind == "json_object":
            return self._llguidance(self._ll_json(_JSON_OBJECT_SCHEMA, spec.whitespace), spec)
        if spec.kind == "grammar":
            return self._llguidance(self._ll_lark(spec), spec)
        if spec.kind == "llguidance":
            return self._llguidance(spec.text, spec)
        if spec.kind == "structural_tag":  # a Lark grammar of its own (jaxserve.structured.compose)
            from jaxserve.structured.compose import compose

            return self._llguidance(compose(spec, None, spec.param).text, spec)
        raise GuideError(spec.param, f"unknown kind of structured output {spec.kind!r}")

    def _outlines(self, job_kind: str, text: str, spec: GuideSpec) -> Grammar:
        worker = self._take_worker()
        # outlines-core puts the whitespace regex in every gap between JSON's tokens as it is;
        # llguidance lets each gap be empty or match it. Grouped and optional, both read it alike
        # (the same for the usual patterns that can match nothing: "[ ]?", "[\\n ]*").
        whitespace = None if spec.whitespace is None else f"(?:{spec.whitespace})?" if spec.whitespace else ""
        try:
            reply = worker.run((job_kind, text, whitespace), self.timeout_s)
        except TimeoutError:
            self.stats["timeouts"] += 1
            worker = None  # killed; a fresh one starts when next needed
            raise GuideError(spec.param, f"compiling the {spec.kind} took longer than the {self.timeout_s:g}s "
                                         "budget (--structured-output-timeout)") from None
        except (EOFError, OSError, BrokenPipeError) as e:
            worker.kill()
            worker = None
            raise RuntimeError(f"the grammar compile worker died: {e}") from e
        finally:
            self._return_worker(worker)
        if reply[0] == "error":
            what = {"json_schema": "unsupported or invalid JSON schema", "regex": "invalid regex"}[job_kind]
            if spec.kind == "choice":
                what = "these choices cannot be compiled"
            detail = (_python_regex_error(text) if job_kind == "regex" else None) or reply[1]
            raise GuideError(spec.param, f"{what}: {detail}")
        _, blob, seconds = reply
        if len(blob) > self.max_index_bytes:
            raise GuideError(spec.param, f"the compiled {spec.kind} needs {len(blob) / 2**20:.1f} MiB, over the "
                                         f"{self.max_index_bytes / 2**20:.0f} MiB budget (--structured-output-max-mib)")
        self.stats["compiled"] += 1
        log.debug("outlines-core index built in %.3fs in a worker", seconds)
        return OutlinesGrammar(pickle.loads(blob), self.vocabulary.eos_ids, spec.kind, len(blob))

    def _take_worker(self) -> _Worker:
        with self._worker_free:
            while True:
                if self._closed:
                    raise RuntimeError("the grammar compiler is closed")
                if self._workers:
                    return self._workers.pop()
                if self._num_started < self.num_workers:
                    self._num_started += 1
                    break
                self._worker_free.wait()
        try:
            return self._start_worker()
        except BaseException:
            with self._worker_free:
                self._num_started -= 1
                self._worker_free.notify()
            raise

    def _return_worker(self, worker: _Worker | None) -> None:
        with self._worker_free:
            if worker is not None and worker.alive and not self._closed:
                self._workers.append(worker)
            else:
                self._num_started -= 1
                if worker is not None:
                    worker.kill()
            self._worker_free.notify()

    def _start_worker(self) -> _Worker:
        eos = self.vocabulary.eos_ids[0] if self.vocabulary.eos_ids else self.vocabulary.size
        return _Worker(("init", self.vocabulary.by_bytes(), eos))

    # ---- llguidance ----------------------------------------------------------------------------
    def _ll(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _llguidance_tokenizer(self.vocabulary, self.hf_tokenizer)
            return self._ll_tokenizer

    def _ll_json(self, schema: str, whitespace: str | None) -> str:
        import llguidance

        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=specs.json_layout(whitespace))

    def _ll_lark(self, spec: GuideSpec) -> str:
        import llguidance

        return llguidance.LLMatcher.grammar_from_lark(specs.as_lark(spec.text, spec.param))

    def _llguidance(self, grammar: str, spec: GuideSpec) -> Grammar:
        import llguidance

        tokenizer = self._ll()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:
            detail = "; ".join(" ".join(m.split()) for m in messages) or "rejected"
            what = "unsupported or invalid JSON schema" if spec.kind == "json_schema" else "invalid grammar"
            raise GuideError(spec.param, f"{what}: {detail}")
        self.stats["compiled"] += 1
        return LLGuidanceGrammar(tokenizer, grammar, spec.kind, (self.vocabulary.size + 31) // 32)

    # ---- cache -------------------------------------------------------------------------------------
    def _insert(self, key: str, grammar: Grammar) -> None:
        self._cache[key] = grammar
        self._cached_bytes += grammar.nbytes
        while self._cache and (len(self._cache) > self.cache_entries or self._cached_bytes > self.cache_bytes):
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes


def _python_regex_error(pattern: str) -> str | None:
    """outlines-core's parse errors say little ("error building NFA"); Python's `re` names the
    problem and its position for the common mistakes. Rust-only syntax that `re` rejects is not
    an error, so this is used only after outlines-core refused the pattern."""
    try:
        re.compile(pattern)
    except re.error as e:
        return str(e)
    return None


class _TokenizerShim:
    """What llguidance's TokenizerWrapper reads: token bytes, specials, EOS, and an encoder."""

    def __init__(self, vocabulary: TokenVocabulary, hf_tokenizer: Any):
        self.eos_token_id = vocabulary.eos_ids[0] if vocabulary.eos_ids else None
        self.bos_token_id = hf_tokenizer.bos_token_id
        specials = [i for i, t in enumerate(vocabulary.tokens) if t is None]
        names = hf_tokenizer.convert_ids_to_tokens(specials)
        # llguidance marks special tokens by a leading 0xFF byte, which no UTF-8 text contains.
        by_id = {i: b"\xff" + (name or f"<special_{i}>").encode() for i, name in zip(specials, names)}
        self.tokens = [t if t is not None else by_id[i] for i, t in enumerate(vocabulary.tokens)]
        self.special_token_ids = specials
        self._hf = hf_tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._hf.encode(text, add_special_tokens=False)


def _llguidance_tokenizer(vocabulary: TokenVocabulary, hf_tokenizer: Any) -> Any:
    import llguidance

    wrapper = llguidance.TokenizerWrapper(_TokenizerShim(vocabulary, hf_tokenizer))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocabulary.size, eos_token=list(vocabulary.eos_ids) or None)
