"""Teachers: a larger model answering the same typed questions, over HTTP, with probabilities.

``connect(url, kind)`` gives a client with an engine's shape (``name``, ``ask(state, questions)``) and
``probabilities(state, questions, deadline=...)`` (each question's option distribution, in the order
:func:`option_keys` names them: yes/no, option names, levels "0"..):

* ``systemone``: any server of the TypeSafe System One wire (another ``onepass serve``, a hosted System
  One API): one ``POST /v1/systemone`` per call with every question;
* ``openai``: an OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, llama.cpp's server, Ollama,
  hosted APIs). Each question is one prompt that lists its options under single-token labels (yes/no for
  noul, A, B, C... otherwise) and asks for one label; one token is generated, and the distribution is
  read from the returned ``top_logprobs`` of that token: the options' label tokens, renormalised. A label
  missing from the top list is given the probability of the least likely token listed (an upper bound of
  its own), so a distribution never claims more certainty than the endpoint showed. An endpoint that
  returns no log-probabilities is a :class:`TeacherBadAnswer` that says so.

Calls are bounded (``max_concurrency`` at a time per client), time-limited (``timeout_s`` per attempt and
the caller's deadline over all of them) and retried with exponential backoff and jitter on connection
errors, timeouts, 408, 429 and 5xx (honouring Retry-After within the deadline). Every failure is a typed
:class:`TeacherError`: :class:`TeacherUnavailable` (down, slow, overloaded), :class:`TeacherRefused` (it
answered 4xx: a wrong key, a request it rejects), :class:`TeacherBadAnswer` (not the wire, no
probabilities, probabilities that are not a distribution).

The HTTP client is httpx2 (what the mcp SDK and the official TypeSafe SDK use); the retry loop is written
here because it must stop at the caller's deadline and honour Retry-After, which the transports' own
retries (connection errors only) do not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..core.errors import OnepassError
from ..core.prompt import state_text
from ..core.questions import Noul, Question, Score, as_text, to_wire, without_task
from ..core.readout import answer

KINDS = ("systemone", "openai")
OPENAI_LABELS = "ABCDEFGHIJKLMNOPQRST"  # 20: the most top_logprobs the OpenAI API returns
RETRY_STATUSES = {408, 425, 429, 500, 502, 503, 504}
MAX_RESPONSE_BYTES = 16 << 20


def _settled_calls_quiet(loop, context) -> None:
    """The client loop's exception handler: a call that ended in a TeacherError after its caller had stopped waiting
    (cancelled by ``cancel()`` or ``close()`` as it failed: asyncio then never hands the error to anyone) was
    settled on purpose, and is not printed as "Task exception was never retrieved"; anything else is, as asyncio
    does."""
    if isinstance(context.get("exception"), TeacherError) and "never retrieved" in context.get("message", ""):
        return
    loop.default_exception_handler(context)


class TeacherError(OnepassError):
    """The teacher gave no usable answer."""


class TeacherUnavailable(TeacherError):
    """Down, too slow for the deadline, or overloaded after every retry."""


class TeacherLate(TeacherUnavailable):
    """The caller's deadline ended the call: ``asked`` says whether an attempt reached the teacher (then it was too
    slow for the time given) or none could start (every connection busy, no time left)."""

    def __init__(self, message: str, asked: bool = True):
        super().__init__(message)
        self.asked = asked


class TeacherRefused(TeacherError):
    """The teacher answered 4xx: a wrong API key or a request it does not accept (not retried)."""


class TeacherBadAnswer(TeacherError):
    """The teacher answered, but not with a usable distribution (garbage, no log-probabilities)."""


def option_keys(question: Question) -> list[str]:
    """How a distribution names a question's options: yes/no, option names, or level indices "0".."""
    if isinstance(question, Noul):
        return ["yes", "no"]
    if isinstance(question, Score):
        return [str(i) for i in range(len(question.criteria))]
    return [as_text(o) for o in question.criteria]


def distribution(question: Question, probs, what: str) -> np.ndarray:
    """A [K] distribution from a wire answer's probabilities keyed by :func:`option_keys`; TeacherBadAnswer
    unless every option has a finite probability >= 0 and they sum to 1 (within 1e-3)."""
    keys = option_keys(question)
    if not isinstance(probs, Mapping) or set(probs) != set(keys):
        got = sorted(probs)[:8] if isinstance(probs, Mapping) else type(probs).__name__
        raise TeacherBadAnswer(f"{what}: probabilities must be keyed by the options {keys[:8]}, got {got}")
    values = [probs[k] for k in keys]
    problem = distribution_problem(values)
    if problem:
        raise TeacherBadAnswer(f"{what}: {problem}")
    return np.asarray(values, dtype=np.float64) / float(sum(values))


def distribution_problem(values: list) -> str | None:
    """What keeps ``values`` from being a distribution (finite numbers >= 0 that sum to 1 within 1e-3), or None:
    the one check of a teacher's answer and of a tune row's ``probabilities``."""
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 for v in values):
        return "every probability must be a finite number >= 0"
    total = float(sum(values))
    if abs(total - 1.0) > 1e-3:
        return f"the probabilities sum to {total:.4f}; they must sum to 1"
    return None


def _check_url(url: str) -> None:
    """A base URL with a scheme, a host and a valid port, and nothing a request line cannot carry."""
    from urllib.parse import urlsplit

    wrong = f"the teacher URL must be http(s)://HOST[:PORT][/PATH], got {url[:80]!r}"
    if not isinstance(url, str) or any(c.isspace() for c in url):
        raise OnepassError(wrong)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise OnepassError(f"{wrong} (its port must be 1..65535)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0 or parts.query or parts.fragment:
        raise OnepassError(wrong)


@dataclass(frozen=True)
class TeacherConfig:
    """Where the teacher is and how it is called."""

    url: str
    kind: str = "systemone"
    api_key: str | None = None
    model: str | None = None  # systemone: the request's model (default: the server's); openai: required by most
    timeout_s: float = 10.0  # one attempt
    retries: int = 2  # attempts after the first
    backoff_s: float = 0.25  # first retry's wait; doubled each retry, with jitter
    max_concurrency: int = 4  # calls in flight per client

    def __post_init__(self):
        if self.kind not in KINDS:
            raise OnepassError(f"teacher kind must be one of {KINDS}, got {self.kind!r}")
        _check_url(self.url)
        if not (isinstance(self.backoff_s, (int, float)) and 0 <= self.backoff_s <= 60):
            raise OnepassError(f"teacher backoff must be within 0..60 seconds, got {self.backoff_s!r}")
        if not 0 < self.timeout_s <= 600:
            raise OnepassError(f"teacher timeout must be within (0, 600] seconds, got {self.timeout_s}")
        if not (isinstance(self.retries, int) and 0 <= self.retries <= 10):
            raise OnepassError(f"teacher retries must be 0..10, got {self.retries}")
        if not (isinstance(self.max_concurrency, int) and 1 <= self.max_concurrency <= 256):
            raise OnepassError(f"teacher concurrency must be 1..256, got {self.max_concurrency}")


class Teacher:
    """A remote model with an engine's shape. Thread-safe; ``close()`` (or ``with``) ends its calls and connections.

    Every exchange runs on an event loop of the client's own (one daemon thread): a blocking caller (``distill``'s
    workers) waits on a future, the server's gate awaits it. An attempt is bounded as a whole (connect, head and
    body) from outside its reads: asyncio cancels it at its limit and the connection is closed, so a teacher that
    trickles its answer a byte at a time ends the attempt on time, not after ``timeout_s`` per byte."""

    path = ""

    def __init__(self, config: TeacherConfig):
        import httpx2

        self.config = config
        self.name = config.model or f"{config.kind}:{config.url.split('://', 1)[1].split('/', 1)[0]}"
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._errors = httpx2.TransportError, httpx2.TimeoutException
        self._decoding, self._other = httpx2.DecodingError, (httpx2.HTTPError, httpx2.StreamError)
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(_settled_calls_quiet)
        self._thread = threading.Thread(target=self._loop.run_forever, name="onepass-teacher", daemon=True)
        self._thread.start()
        self._calls: set = set()  # the futures of the calls spawned and not done
        self._lock = threading.Lock()  # spawn, cancel and close, from any thread
        self._closed = False
        self._cancels = 0  # cancel() calls so far: an attempt of an older call does not start (asyncio.wait_for can
        # swallow a cancellation that meets its result, python/cpython#86296)

        async def open_client():
            self._slots = asyncio.Semaphore(config.max_concurrency)
            return httpx2.AsyncClient(base_url=config.url.rstrip("/"), headers=headers,
                                      limits=httpx2.Limits(max_connections=config.max_concurrency),
                                      timeout=httpx2.Timeout(config.timeout_s))

        try:
            self._http = asyncio.run_coroutine_threadsafe(open_client(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the client's loop; its future (``cancel()`` and ``close()`` cancel it, started or not).
        TeacherUnavailable once the client is closed."""
        with self._lock:
            if self._closed:
                coro.close()
                raise TeacherUnavailable(f"{self.name}: the teacher client is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
            self._calls.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future) -> None:
        with self._lock:
            self._calls.discard(future)

    def _wait(self, coro):
        """``coro``'s result, run on the client's loop, for a blocking caller (its own deadline bounds it)."""
        future = self.spawn(coro)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise TeacherUnavailable(f"{self.name}: the call was cancelled (the client stopped)") from None
        except BaseException:  # Ctrl-C in the waiting thread: the call ends too
            future.cancel()
            raise

    def cancel(self) -> None:
        """End every call spawned and not done, now (a blocking caller gets TeacherUnavailable, an awaiting one a
        cancelled future)."""
        with self._lock:
            self._cancels += 1
            calls = list(self._calls)
        for future in calls:
            future.cancel()

    def close(self) -> None:
        """Cancel the calls, close the connections, stop the loop's thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._cancels = True, self._cancels + 1
            calls = list(self._calls)
        for future in calls:
            future.cancel()

        async def shut():  # every call and attempt ended (their errors seen) before the connections close
            for _ in range(3):
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                if not tasks:
                    break
                for task in tasks:
                    task.cancel()
                done, _ = await asyncio.wait(tasks, timeout=1.0)
                for task in done:
                    if not task.cancelled():
                        task.exception()
            await self._http.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
        except (concurrent.futures.TimeoutError, OSError):  # a connection that will not close: the thread is a daemon
            pass
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config.url!r}, name={self.name!r})"

    def ask(self, state, questions: Mapping[str, Question], deadline: float | None = None) -> dict:
        """Typed answers by question id (what an engine's ``ask`` returns)."""
        probs = self.probabilities(state, questions, deadline)
        return {qid: answer(questions[qid], p) for qid, p in probs.items()}

    def probabilities(self, state, questions: Mapping[str, Question], deadline: float | None = None) -> dict:
        """{question id: [K] distribution}; ``deadline`` (monotonic seconds) bounds every attempt and retry (none:
        ``timeout_s`` per attempt over every attempt)."""
        return self._wait(self.aprobabilities(state, questions, deadline))

    async def aprobabilities(self, state, questions: Mapping[str, Question], deadline: float | None = None) -> dict:
        """:meth:`probabilities` as a coroutine of the client's loop (what :meth:`spawn` runs)."""
        raise NotImplementedError

    async def post(self, body: dict, deadline: float | None) -> dict:
        """POST ``body`` as JSON to the kind's path; the parsed JSON object of a 200, retrying what may pass. Each
        attempt ends within ``timeout_s`` and by ``deadline`` whatever the teacher sends (TeacherLate when the
        deadline cut the last one)."""
        cfg = self.config
        cancels = self._cancels
        given = deadline is not None  # else the attempts' own limits make the deadline: no call is "late"
        deadline = time.monotonic() + cfg.timeout_s * (cfg.retries + 1) if deadline is None else deadline
        last, made, late = "the deadline had passed before the first attempt", 0, False
        for attempt in range(cfg.retries + 1):
            if self._cancels != cancels:
                raise TeacherUnavailable(f"{self.name}: the call was cancelled (the client stopped)")
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._slots.acquire(), left)
            except asyncio.TimeoutError:
                last, late = f"all {cfg.max_concurrency} connections busy", given
                break
            made += 1
            limit = max(0.0, min(cfg.timeout_s, deadline - time.monotonic()))
            late = False
            attempt_task = asyncio.ensure_future(self._attempt(body))
            attempt_task.add_done_callback(_retrieved)  # one that ends after its caller was cancelled logs nothing
            try:
                outcome = await asyncio.wait_for(attempt_task, limit)
            except asyncio.TimeoutError:  # the attempt's limit, enforced from outside its reads
                late = given and limit < cfg.timeout_s
                outcome = (f"no whole answer by the deadline ({limit:.3g} s left)" if late
                           else f"no whole answer within {limit:.3g} s (the teacher's timeout: {cfg.timeout_s:g} s)"), 0.0
            finally:
                self._slots.release()
            if isinstance(outcome, dict):
                return outcome
            last, asked = outcome
            wait = max(cfg.backoff_s * (2 ** attempt) * (0.5 + random.random()), asked)
            if attempt == cfg.retries:
                break
            if time.monotonic() + wait >= deadline:
                last += f"; a retry {wait:.3g} s later would pass the deadline"
                break
            await asyncio.sleep(wait)
        message = (f"{self.name} at {cfg.url} gave no answer within the deadline ({made} of {cfg.retries + 1} "
                   f"attempts made; last: {last})")
        if late or (given and not made):
            raise TeacherLate(message, asked=made > 0)
        raise TeacherUnavailable(message)

    async def _attempt(self, body: dict):
        """One exchange: the JSON object of a 200, or (why it failed, seconds the teacher asked to wait) where a retry
        may pass; the typed error where none can."""
        try:
            async with self._http.stream("POST", self.path, json=body) as response:
                content = bytearray()
                async for chunk in response.aiter_bytes():
                    content += chunk
                    if len(content) > MAX_RESPONSE_BYTES:
                        raise TeacherBadAnswer(f"{self.name} sent a response over {MAX_RESPONSE_BYTES >> 20} MiB")
                status, headers = response.status_code, response.headers
        except self._errors as err:
            return (f"{type(err).__name__}: {err}" if str(err) else type(err).__name__), 0.0
        except self._decoding as err:  # a body its headers misdescribe (a Content-Encoding it is not in)
            raise TeacherBadAnswer(f"{self.name} sent a body that cannot be decoded: {err}") from None
        except self._other as err:  # anything else the HTTP client raises: typed, never a traceback
            raise TeacherUnavailable(f"{self.name}: {type(err).__name__}: {err}") from None
        if status == 200:
            try:
                data = json.loads(content)
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise TeacherBadAnswer(f"{self.name} answered 200 with a body that is not JSON: "
                                       f"{bytes(content[:80])!r}") from None
            if not isinstance(data, dict):
                raise TeacherBadAnswer(f"{self.name} answered 200 with JSON that is not an object")
            return data
        if 300 <= status < 400:
            raise TeacherRefused(f"{self.name} answered HTTP {status}, a redirect to "
                                 f"{headers.get('location', '(no Location header)')[:200]!r}: redirects are not "
                                 "followed; give the final URL as the teacher's")
        why = f"HTTP {status}: {_error_message(bytes(content))}"
        if status not in RETRY_STATUSES:
            raise TeacherRefused(f"{self.name} refused the request ({why})")
        asked = _retry_after(headers)
        return (f"{why} (it asked to wait {asked:g} s)" if asked else why), asked


def _retrieved(task: asyncio.Task) -> None:
    """Mark a finished attempt's exception as seen (its caller reports what matters)."""
    if not task.cancelled():
        task.exception()


def _error_message(content: bytes) -> str:
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return content[:120].decode("utf-8", "replace")
    err = data.get("error", data) if isinstance(data, dict) else data
    message = err.get("message", err) if isinstance(err, dict) else err
    return str(message)[:200]


def _retry_after(headers) -> float:
    """Seconds a Retry-After header asks for (a date, or nonsense: 0); the caller's deadline bounds the wait."""
    try:
        seconds = float(headers.get("retry-after", 0))
    except ValueError:
        return 0.0
    return min(1e6, seconds) if seconds > 0 else 0.0


class SystemOneTeacher(Teacher):
    """A server of the TypeSafe System One wire."""

    path = "/v1/systemone"

    async def aprobabilities(self, state, questions, deadline=None) -> dict:
        # a question's task is this engine's own (its tuned adapter): the teacher is asked the question itself
        body = {"state": state, "questions": {qid: to_wire(without_task(q)) for qid, q in questions.items()}}
        if self.config.model:
            body["model"] = self.config.model
        data = await self.post(body, deadline)
        answers = data.get("answers")
        if not isinstance(answers, dict):
            raise TeacherBadAnswer(f"{self.name}: the response has no 'answers' object")
        out = {}
        for qid, q in questions.items():
            got = answers.get(qid)
            if not isinstance(got, dict) or got.get("type") != q.type:
                raise TeacherBadAnswer(f"{self.name}: no {q.type} answer for question {qid!r}")
            if isinstance(q, Noul):
                p = got.get("noul")
                if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                    raise TeacherBadAnswer(f"{self.name}: question {qid!r}: noul must be a probability 0..1")
                out[qid] = np.array([float(p), 1.0 - float(p)])
            else:
                out[qid] = distribution(q, got.get("probabilities"), f"{self.name}: question {qid!r}")
        return out


def openai_prompt(state, question: Question) -> tuple[list[dict], list[str]]:
    """(chat messages, the options' labels) asking one question as one label to pick."""
    keys = option_keys(question)
    if isinstance(question, Noul):
        labels, lines = ["yes", "no"], []
        ask = "Answer yes or no."
    else:
        if len(keys) > len(OPENAI_LABELS):
            raise TeacherRefused(f"an OpenAI-compatible teacher reads at most {len(OPENAI_LABELS)} options "
                                 f"(top_logprobs), this question has {len(keys)}")
        labels = list(OPENAI_LABELS[:len(keys)])
        if isinstance(question, Score):
            texts = [as_text(c) for c in question.criteria]
            lines = [f"{lab}. {t}" for lab, t in zip(labels, texts)]
            ask = "The options are levels from lowest to highest. Answer with the letter of one option."
        else:
            lines = [f"{lab}. {name}" + (f" ({as_text(desc)})" if desc is not None else "")
                     for lab, (name, desc) in zip(labels, question.criteria.items())]
            ask = "Answer with the letter of one option."
    instructions = as_text(question.instructions) if question.instructions is not None else ""
    user = "\n".join([f"Text:\n{state_text(state)}", "", f"Question: {instructions}",
                      *(["Options:", *lines] if lines else []), "", ask])
    system = "You answer questions about a text. Reply with the answer label only, nothing else."
    return [{"role": "system", "content": system}, {"role": "user", "content": user}], labels


def label_distribution(top: list, labels: list[str], noul: bool) -> np.ndarray:
    """Option probabilities from one token's ``top_logprobs`` ([{token, logprob}]); TeacherBadAnswer when none of
    the labels is among them."""
    found = dict.fromkeys(labels, 0.0)
    floor = math.inf
    for item in top:
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            raise TeacherBadAnswer("top_logprobs entries must be objects with a token and a logprob")
        lp = item.get("logprob")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or math.isnan(lp) or lp > 1e-6:
            raise TeacherBadAnswer(f"a logprob must be a number <= 0, got {lp!r}")
        p = math.exp(lp)
        floor = min(floor, p)
        token = item["token"].strip().strip(".):").strip()
        token = token.lower() if noul else token
        if token in found:
            found[token] += p
    if not any(found.values()):
        listed = [item.get("token") for item in top[:8]]
        raise TeacherBadAnswer(f"none of the option labels {labels[:8]} is among the answer token's top "
                               f"log-probabilities (listed: {listed})")
    floor = 0.0 if floor is math.inf else floor
    values = np.array([found[lab] or floor for lab in labels], dtype=np.float64)
    return values / values.sum()


class OpenAITeacher(Teacher):
    """An OpenAI-compatible chat-completions endpoint; one call per question."""

    path = "/v1/chat/completions"

    async def aprobabilities(self, state, questions, deadline=None) -> dict:
        out = {}
        for qid, q in questions.items():
            messages, labels = openai_prompt(state, q)
            body = {"messages": messages, "max_tokens": 1, "temperature": 0.0, "logprobs": True,
                    "top_logprobs": min(20, max(5, 2 * len(labels)))}
            if self.config.model:
                body["model"] = self.config.model
            data = await self.post(body, deadline)
            try:
                content = data["choices"][0]["logprobs"]["content"]
            except (KeyError, IndexError, TypeError):
                content = None
            if not content or not isinstance(content, list) or not isinstance(content[0], dict) \
                    or not content[0].get("top_logprobs"):
                raise TeacherBadAnswer(f"{self.name} returned no log-probabilities for question {qid!r}: the "
                                       "endpoint must support chat completions with logprobs=true and "
                                       "top_logprobs (vLLM, llama.cpp's server, OpenAI do)")
            out[qid] = label_distribution(content[0]["top_logprobs"], labels, isinstance(q, Noul))
        return out


def connect(url: str, kind: str = "systemone", **settings) -> Teacher:
    """A teacher client of ``kind`` at ``url`` (settings: :class:`TeacherConfig`'s fields)."""
    config = TeacherConfig(url=url, kind=kind, **settings)
    return (SystemOneTeacher if kind == "systemone" else OpenAITeacher)(config)


def answer_distribution(question: Question, answer) -> np.ndarray:
    """A typed answer's [K] distribution, in :func:`option_keys` order."""
    if isinstance(question, Noul):
        return np.array([answer.noul, 1.0 - answer.noul])
    return np.array([answer.probabilities[k] for k in option_keys(question)], dtype=np.float64)


def wire_probabilities(question: Question, probs: np.ndarray) -> dict:
    """A distribution as a ``tune`` row's ``probabilities``: keyed by :func:`option_keys`."""
    return {k: float(p) for k, p in zip(option_keys(question), probs)}


def row(state, question: Question, probs: np.ndarray, teacher: str) -> dict:
    """One ``onepass tune`` row of a teacher's answer."""
    return {"state": state, "question": to_wire(question), "probabilities": wire_probabilities(question, probs),
            "teacher": teacher}


def dumps(value: dict) -> bytes:
    """One JSONL line."""
    return (json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
