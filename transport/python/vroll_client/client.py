"""VrollClient: generation, weight updates and control for one or more vroll-worker processes.

One DEALER socket per worker endpoint; every request carries a correlation ``id`` unique within
the client and every reply is matched by it, so replies to requests the client has given up on
(after an error or a timeout) are recognised and dropped.

Weight update with several workers (two-phase):

    trainer                    worker A                     worker B
    update_begin ------------> begun                        begun
    update_chunk x k --------> staged (no reply)            staged
    update_commit apply=false> verified                     verified      <- phase one
    update_apply ------------> applied(version, checksum)   applied       <- only if all verified
    (any begin/chunk/verify failure: update_abort to every worker, nothing applied)
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import numbers
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import zmq

from . import protocol
from .types import (CompletionOutput, RequestOutput, SamplingParams, UpdateAck, VrollError,
                    VrollTimeoutError, WeightUpdateError, WorkerError)
from .weights import (DEFAULT_CHUNK_BYTES, WireTensor, chunk_ranges, to_wire, weights_checksum_from_digests,
                      wire_digests)

logger = logging.getLogger("vroll_client")

KeyLike = Union[str, bytes]

#: Longest back-off before re-sending a request a worker refused as ``overloaded``.
_MAX_OVERLOAD_BACKOFF_S = 1.0
#: How long update_abort may take when cleaning up after a failed push.
_ABORT_TIMEOUT_S = 10.0

# push_weights/ensure_weights' rope_layout when the caller gives none: the order of a transformers
# state_dict, sent in update_begin for the worker to check (docstring of push_weights).
HF_ROPE_LAYOUT = "half_split"


#: A call made while a generate_iter() iteration is open (its replies would be read by the call).
_ITERATING_MESSAGE = (
    "the client is in the middle of a generate_iter() iteration: finish it, or end it first: "
    "`break` ends it only in `for out in client.generate_iter(...)`; an iterator kept in a variable "
    "stays open after a `break` out of a loop over it until its close() (which aborts its "
    "unfinished requests) or until it is garbage-collected")

#: How long push_weights waits for the update_abort acks after an interrupt (Ctrl-C).
_INTERRUPT_ABORT_TIMEOUT_S = 2.0


def _exclusive(method: Callable[..., Any]) -> Callable[..., Any]:
    """Runs a public method of VrollClient as the one call inside the client (_enter)."""
    @functools.wraps(method)
    def wrapper(self: "VrollClient", *args: Any, **kwargs: Any) -> Any:
        self._enter(method.__name__)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._leave()
    return wrapper


#: RoPE inverse-frequency buffers in older transformers state_dict()s: not parameters.
_ROTARY_BUFFER_SUFFIX = ".rotary_emb.inv_freq"


class _DefaultRopeLayout(str):
    """The rope_layout default: HF_ROPE_LAYOUT, told apart from the same value given explicitly."""


_DEFAULT_ROPE_LAYOUT = _DefaultRopeLayout(HF_ROPE_LAYOUT)
_ROPE_LAYOUT_HINT = ("push_weights assumes Hugging Face (half_split) q_proj/k_proj row order unless told: pass "
                     "rope_layout='interleaved' for llama2.c-ordered weights (e.g. vroll_llama's hf_state_dict()), "
                     "or permute the rows")
#: How long the socket of a worker that went silent during generate lingers, after a reset, to
#: deliver the aborts of its requests.
_SILENCE_ABORT_LINGER_MS = 100
#: Chunks sent between two non-blocking checks for early chunk errors.
_CHUNKS_PER_ERROR_CHECK = 64
#: A worker aborts an update that gets no message for its update_timeout_ms (sent in its
#: ``begun`` and ``verified`` acks); a push that waits on other workers sends it a message every
#: third of that. A worker whose acks do not say it (an older one) gets none.
_KEEPALIVE_FRACTION = 1.0 / 3.0
#: How long a generate with a min_policy_version waits for the workers' health replies that
#: tell it where that version runs (at most timeout_s).
_VERSION_CHECK_TIMEOUT_S = 10.0
# A worker that did not answer the last version check is waited for this long only, so that a
# stopped worker does not cost every generate call the full check; it is waited for in full
# again once it answers.
_SILENT_RECHECK_S = 1.0


def _keepalive_period(ack: Mapping[str, Any]) -> Optional[float]:
    """Seconds between keep-alives for the update an ack is about (None: the worker did not
    say its update_timeout_ms)."""
    timeout_ms = ack.get("update_timeout_ms")
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or timeout_ms <= 0:
        return None
    return _KEEPALIVE_FRACTION * timeout_ms / 1000.0


def _key_bytes(key: KeyLike, what: str) -> bytes:
    """A CURVE key as ZeroMQ takes it: 32 raw bytes or 40 Z85 characters."""
    raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    if len(raw) not in (32, 40):
        raise ValueError(f"{what} must be 32 raw bytes or 40 Z85 characters, got {len(raw)}")
    return raw



_TIED_HEAD = "lm_head.weight"
_EMBEDDING = "model.embed_tokens.weight"


def _expected_weights_checksums(tensors: List[WireTensor], named_tensors: Mapping[str, Any]):
    """The weights_checksum an applied full update may report: that of named_tensors, and,
    when lm_head.weight goes as a copy of model.embed_tokens.weight (same dtype, shape and
    checksum on the wire), also that of the rest: a worker whose model ties the two holds one
    matrix and uses the embedding (docs/PROTOCOL.md, update_begin). One pass over the tensors."""
    digests = wire_digests(tensors, named_tensors)
    expected = {weights_checksum_from_digests(digests)}
    by_name = {t.name: t for t in tensors}
    head, embedding = by_name.get(_TIED_HEAD), by_name.get(_EMBEDDING)
    if head is not None and embedding is not None and (head.dtype, head.shape, head.checksum) == (
            embedding.dtype, embedding.shape, embedding.checksum):
        head_name = _TIED_HEAD.encode("utf-8")
        expected.add(weights_checksum_from_digests([d for d in digests if d[0] != head_name]))
    return expected

class _Worker:
    """One endpoint: its DEALER socket and the client's bookkeeping for it. Owned by one client."""

    def __init__(self, context: zmq.Context, index: int, endpoint: str,
                 server_key: Optional[bytes], client_keys: Optional[Tuple[bytes, bytes]],
                 timeout_s: float, linger_ms: int):
        # Immutable after construction.
        self.index = index
        self.endpoint = endpoint
        self._context = context
        self._server_key = server_key
        self._client_keys = client_keys
        self._timeout_s = timeout_s
        self._linger_ms = linger_ms
        # Replaced by reset().
        self.socket: zmq.Socket = self._connect()
        # Whether it left the last min_policy_version health check unanswered.
        self.silent_at_version_check = False
        # Whether anything ever arrived from this endpoint (any socket): a timeout before that is
        # as likely a connection that never came up (a CURVE mismatch, no worker there) as a
        # hung worker, which the error then says.
        self.ever_heard = False
        # generate() bookkeeping, reset at the start of every call (reset_generate()).
        self.last_heard = 0.0
        self.reset_generate()

    def reset_generate(self) -> None:
        """Forgets the previous generate() call's load and overload state."""
        self.num_inflight_samples = 0
        self.num_inflight_requests = 0
        # Requests of ours the worker accepted and has not finished.
        self.num_accepted_requests = 0
        # Overload control (see VrollClient._on_generate_reply): after an ``overloaded`` refusal,
        # at most request_limit requests in flight (None: no limit known), and none sent before
        # backoff_until (0: no back-off) unless one of ours finishes first.
        self.request_limit: Optional[int] = None
        self.backoff_until = 0.0
        self.num_overloaded = 0

    def _connect(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, self._linger_ms)
        # Unbounded receive queue: a ROUTER drops replies to a peer whose queue is full, and a
        # lost sample would only surface as a timeout.
        sock.setsockopt(zmq.RCVHWM, 0)
        # A send that cannot be queued for timeout_s (worker gone, queue full) raises zmq.Again.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self._timeout_s * 1000)))
        # ZMTP heartbeats notice a vanished machine (no TCP reset) and reconnect.
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        if self._server_key is not None:
            public, secret = self._client_keys
            sock.setsockopt(zmq.CURVE_SERVERKEY, self._server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        if self.endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"endpoint {self.endpoint!r}: {exc} (expected e.g. tcp://HOST:PORT or "
                             f"ipc:///PATH)") from None
        return sock

    def reset(self, linger_ms: int = 0) -> None:
        """Closes the socket and reconnects on a new one (after a timeout: a restarted worker
        must not receive the dead one's backlog). Messages still queued on the old socket go out
        for up to linger_ms (0: dropped at once)."""
        self.socket.close(linger=linger_ms)
        self.socket = self._connect()

    def close(self, linger_ms: Optional[int] = None) -> None:
        self.socket.close(linger=self._linger_ms if linger_ms is None else linger_ms)


def _is_update_shutdown(header: Mapping[str, Any]) -> bool:
    """The worker's notice that it aborted the open update because it is shutting down
    (docs/PROTOCOL.md, shutdown): no reply to the update's messages will come, and no abort is
    needed."""
    return (header.get("type") == "error" and header.get("code") == "shutting_down"
            and header.get("field") == "update_id")


def _is_int(value: Any) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_timeout(name: str, value: Any) -> float:
    """A timeout in seconds: a finite number > 0 (else ValueError naming it; inf is refused too:
    sockets and polls take whole milliseconds)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} = {value!r} must be a finite number of seconds > 0")
    return float(value)


def _check_int(name: str, value: Any, minimum: int) -> int:
    """An int (numpy ints too, not bool) >= minimum: else TypeError / ValueError naming it."""
    if not _is_int(value):
        raise TypeError(f"{name} = {value!r} must be an int")
    if value < minimum:
        raise ValueError(f"{name} = {value!r} must be >= {minimum}")
    return int(value)


def _check_seconds(name: str, value: Any) -> float:
    """A finite number of seconds >= 0 (0: not at all), else TypeError / ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} = {value!r} must be a number of seconds")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} = {value!r} must be a finite number of seconds >= 0")
    return float(value)


def _check_endpoint(endpoint: Any) -> str:
    """An endpoint to connect to: a str; for tcp://, a port in [1, 65535] (what the worker
    checks when it binds; ZeroMQ would accept a larger one here and only time out later)."""
    if not isinstance(endpoint, str):
        raise TypeError(f"endpoint {endpoint!r} must be a str such as 'tcp://HOST:PORT' or 'ipc:///PATH'")
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[-1] if endpoint.count(":") >= 2 else ""
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"endpoint {endpoint!r}: the port must be a number in [1, 65535] "
                             "(expected tcp://HOST:PORT)")
    return endpoint


def _prompt_list(prompts: Any) -> List[Any]:
    """generate()'s prompts as a list of token-id sequences: one prompt given flat (a list of
    ints, a 1-D numpy array or torch tensor) or as vLLM's ``{"prompt_token_ids": [...]}``
    becomes a list of one; a 2-D array or tensor, one prompt per row; a 1-D array of token
    lists (numpy object array, pandas Series), one prompt per element; dicts in a list are
    unwrapped too. TypeError names what is malformed (nothing is sent)."""
    def is_id(value: Any) -> bool:
        return _is_int(value) or getattr(value, "ndim", None) == 0  # numpy / torch scalars

    def unwrap(prompt: Any, i: int) -> Any:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" not in prompt:
                raise TypeError(f"prompts[{i}]: a prompt dict needs 'prompt_token_ids' (got keys "
                                f"{sorted(map(str, prompt))!r}); text prompts are not supported: tokenize first")
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, (str, bytes)):
            raise TypeError(f"prompts[{i}] = {prompt!r}: text prompts are not supported (token ids only): "
                            "tokenize first")
        if getattr(prompt, "ndim", None) == 1 and hasattr(prompt, "tolist"):
            prompt = prompt.tolist()  # plain ints: one conversion, not one per element
        return prompt

    if isinstance(prompts, Mapping):
        return [unwrap(prompts, 0)]
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts = {prompts!r}: text prompts are not supported (token ids only): tokenize first")
    ndim = getattr(prompts, "ndim", None)  # numpy arrays, torch tensors, pandas Series
    if ndim is not None and ndim not in (1, 2):
        raise TypeError(f"prompts: a {ndim}-D array; expected one prompt (1-D) or one per row (2-D)")
    if ndim is not None and hasattr(prompts, "tolist"):
        prompts = prompts.tolist()
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"prompts = {prompts!r} must be a list of token-id lists (or one list of token ids)") from None
    if prompts and is_id(prompts[0]):
        return [prompts]  # one prompt given flat, as vLLM accepts
    if prompts and isinstance(prompts[0], numbers.Real) and not isinstance(prompts[0], bool):
        # e.g. a float array: one prompt given flat, with a value that is no token id
        raise TypeError(f"prompt[0] = {prompts[0]!r} is not an integer (token ids are ints; a flat list is one "
                        "prompt)")
    return [unwrap(p, i) for i, p in enumerate(prompts)]


def _check_n(n: Any, what: str) -> int:
    """n as an int in [1, 2**64); ValueError naming `what` else (numpy ints are fine)."""
    if not _is_int(n) or n < 1:
        raise ValueError(f"{what} = {n!r} must be an int >= 1")
    if n >= protocol.WIRE_INT_END:
        raise ValueError(f"{what} = {n} must be < 2**64")
    return int(n)


@dataclass
class _PendingRequest:
    """generate() state of one prompt."""

    index: int
    request_id: str
    header: Dict[str, Any]
    n: int
    samples: List[Optional[CompletionOutput]]
    worker: Optional[_Worker] = None
    accepted: bool = False
    num_received: int = 0
    first_overloaded_at: Optional[float] = None


class VrollClient:
    """A client of one or more vroll workers (docs/PROTOCOL.md, docs/SCALE_OUT.md).

    Thread safety: none. A client and its sockets belong to one thread at a time; use one
    client per thread (several clients may talk to the same workers at once, e.g. one
    generating while another pushes weights). A call made from another thread while one is
    inside the client (a generate_iter iteration counts from its start to its end) raises
    RuntimeError naming both threads, before anything is sent. Handing a client from one
    thread to another between calls is fine.

    Errors: a caller's bad argument raises TypeError/ValueError before anything is sent; a
    worker's ``error`` reply raises WorkerError (code, field, message, worker); a worker that
    owes a reply and stays silent for ``timeout_s`` raises VrollTimeoutError; weight updates
    raise WeightUpdateError. All of these derive from VrollError (VrollTimeoutError also from
    TimeoutError). After any of them the client stays usable, and after a KeyboardInterrupt
    too: an interrupted generate aborts its unfinished requests, an interrupted push_weights
    its update on every worker (waiting at most 2 s for the acks), and a message cut short
    by the interrupt is dropped with its socket.
    """

    def __init__(self, endpoints: Union[str, Sequence[str]],
                 curve_server_key: Union[None, KeyLike, Sequence[KeyLike],
                                         Mapping[str, KeyLike]] = None,
                 curve_client_keys: Optional[Tuple[KeyLike, KeyLike]] = None,
                 timeout_s: float = 120.0, max_in_flight: int = 256,
                 context: Optional[zmq.Context] = None, linger_ms: int = 1000):
        """Connects to the workers (ZeroMQ connects lazily: an absent worker is not an error
        until a request to it times out).

        Args:
          endpoints: one ZeroMQ endpoint (``tcp://host:port``, ``ipc:///path``) or a list.
          curve_server_key: the worker's CURVE public key (40-char Z85 str or 32 bytes) when the
            workers run with CURVE: one key for all, a list parallel to ``endpoints``, or a
            {endpoint: key} map. Requires ``curve_client_keys``.
          curve_client_keys: (public, secret) CURVE key pair of this client; the public key must
            be on the worker's allow-list (its trainer list for updates and control).
          timeout_s: seconds a worker may stay silent while it owes a reply (also the longest a
            send may block). Bounds silence, not a whole call: a long generate is fine as long as
            samples keep arriving; size it above the slowest single sample. While every request
            on a worker waits on a ``min_policy_version`` above its version, the worker's liveness
            probes (every ``--heartbeat-ms``, default 10 s) count as replies, so such requests may
            wait longer than timeout_s when ``--heartbeat-ms`` is below it; a paused or stuck
            worker with requests that could run still times out.
          max_in_flight: unfinished samples (n per request) the client keeps at each worker; a
            request with n above it is still sent, alone.
          context: a zmq.Context to use (default: the process-wide instance).
          linger_ms: how long close() waits to flush queued messages.
        Raises:
          ValueError: no endpoint, a duplicate endpoint, a tcp port outside [1, 65535], a
            timeout_s that is not a finite number > 0, max_in_flight < 1, linger_ms < 0, a
            malformed key, a key without the other.
          TypeError: an endpoint that is not a str; max_in_flight or linger_ms not an int.
        """
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        elif isinstance(endpoints, (bytes, bytearray)):
            raise TypeError(f"endpoints = {endpoints!r} must be a str or a list of str "
                            "(tcp://HOST:PORT, ipc:///PATH)")
        endpoints = [_check_endpoint(ep) for ep in endpoints]
        if not endpoints:
            raise ValueError("endpoints is empty")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"duplicate endpoint in {endpoints}")
        timeout_s = _check_timeout("timeout_s", timeout_s)
        max_in_flight = _check_int("max_in_flight", max_in_flight, 1)
        linger_ms = _check_int("linger_ms", linger_ms, 0)
        server_keys = self._server_keys(endpoints, curve_server_key)
        client_keys = None
        if curve_client_keys is not None:
            if curve_server_key is None:
                raise ValueError("curve_client_keys given without curve_server_key")
            public, secret = curve_client_keys
            client_keys = (_key_bytes(public, "curve_client_keys[0] (public)"),
                           _key_bytes(secret, "curve_client_keys[1] (secret)"))
        elif curve_server_key is not None:
            raise ValueError("curve_server_key needs curve_client_keys=(public, secret): the "
                             "worker admits only public keys on its allow-list")

        self.timeout_s = float(timeout_s)
        self.max_in_flight = int(max_in_flight)
        self._context = context or zmq.Context.instance()
        self._workers = [
            _Worker(self._context, i, ep, server_keys[i], client_keys, self.timeout_s, linger_ms)
            for i, ep in enumerate(endpoints)]
        self._by_endpoint = {w.endpoint: w for w in self._workers}
        self._poller = zmq.Poller()
        for w in self._workers:
            self._poller.register(w.socket, zmq.POLLIN)
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._round_robin = 0
        self._iterating = False  # a generate()/generate_iter() collection is under way
        self._closed = False
        # The call inside the client (_enter): (thread ident, thread name, method) and how deep
        # (a public method calling another), held from start to end of a generate_iter iteration.
        self._busy = threading.Lock()
        self._busy_owner: Optional[Tuple[int, str, str]] = None
        self._busy_depth = 0

    @staticmethod
    def _server_keys(endpoints: List[str], key: Any) -> List[Optional[bytes]]:
        if key is None:
            return [None] * len(endpoints)
        if isinstance(key, (str, bytes)):
            return [_key_bytes(key, "curve_server_key")] * len(endpoints)
        if isinstance(key, Mapping):
            missing = [ep for ep in endpoints if ep not in key]
            if missing:
                raise ValueError(f"curve_server_key has no key for {missing}")
            return [_key_bytes(key[ep], f"curve_server_key[{ep!r}]") for ep in endpoints]
        keys = list(key)
        if len(keys) != len(endpoints):
            raise ValueError(f"curve_server_key lists {len(keys)} keys for {len(endpoints)} "
                             "endpoints")
        return [_key_bytes(k, f"curve_server_key[{i}]") for i, k in enumerate(keys)]

    # -----------------------------------------------------------------------------------------
    # Life cycle.

    @property
    def endpoints(self) -> List[str]:
        """The workers' endpoints, in the order given."""
        return [w.endpoint for w in self._workers]

    def close(self, linger_ms: Optional[int] = None) -> None:
        """Closes every socket (waiting up to linger_ms to flush). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.close(linger_ms)

    def __enter__(self) -> "VrollClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # Plumbing: ids, send, receive, one request per worker.

    def _enter(self, call: str) -> None:
        """Marks `call` as inside the client on this thread. Raises RuntimeError, before anything
        is sent, while another thread is inside it: the sockets are not thread-safe, and two
        threads interleaving (one half of a message from each, a reply read by the other) fail
        in misleading ways, or an applied push raises."""
        me = threading.get_ident()
        owner = self._busy_owner
        if owner is not None and owner[0] == me:  # a call made by the call inside, or in its loop body
            self._busy_depth += 1
            return
        if not self._busy.acquire(blocking=False):
            owner = self._busy_owner or (0, "another thread", "a call")
            raise RuntimeError(
                f"VrollClient.{call}() called from thread {threading.current_thread().name!r} while thread "
                f"{owner[1]!r} is in VrollClient.{owner[2]}(): a client belongs to one thread at a time "
                "(its ZeroMQ sockets are not thread-safe); give each thread its own VrollClient")
        self._busy_owner = (me, threading.current_thread().name, call)
        self._busy_depth = 1

    def _leave(self) -> None:
        self._busy_depth -= 1
        if self._busy_depth == 0:
            self._busy_owner = None
            self._busy.release()

    def _next_id(self, kind: str) -> str:
        return f"{self._id_prefix}-{kind}{next(self._ids)}"

    def _select(self, endpoints: Optional[Sequence[str]]) -> List[_Worker]:
        if endpoints is None:
            return list(self._workers)
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        endpoints = list(endpoints)
        if not endpoints:  # generate() would wait for nothing, forever; push_weights update nobody
            raise ValueError("endpoints = [] selects no worker (None: all of this client's "
                             f"workers, {self.endpoints})")
        unknown = [ep for ep in endpoints if ep not in self._by_endpoint]
        if unknown:
            raise ValueError(f"unknown endpoint(s) {unknown}; this client has {self.endpoints}")
        return [self._by_endpoint[ep] for ep in endpoints]

    def _send(self, worker: _Worker, header: Mapping[str, Any], frames: Sequence[Any] = (),
              request: str = "", block: bool = True) -> None:
        """Sends [header, *frames]. Blocking: up to timeout_s, then VrollTimeoutError; not
        blocking: zmq.Again when the worker's queue is full."""
        if self._closed:
            raise VrollError("the client is closed")
        parts = [protocol.encode(header), *frames]
        flags = 0 if block else zmq.NOBLOCK
        num_sent = 0
        try:
            # Frame by frame, as send_multipart does. ZeroMQ takes the later frames of a message
            # whose first one it took (the high-water mark counts whole messages), so only the
            # first can raise zmq.Again.
            for i, part in enumerate(parts):
                worker.socket.send(part, flags | (zmq.SNDMORE if i + 1 < len(parts) else 0), copy=False)
                num_sent = i + 1
        except zmq.Again:
            if not block:
                raise
            raise VrollTimeoutError(worker.endpoint, f"sending {request or header['type']}",
                                    self.timeout_s) from None
        except BaseException:
            # Interrupted (Ctrl-C) part way through a message: the frames queued so far would be
            # joined to the next message sent on this socket (a chunk header with the next
            # request as its bytes). A new socket drops them; the worker sees a new peer, and
            # drops the old one's open update at the next update_begin from anyone.
            if len(parts) > 1 and num_sent < len(parts):
                self._reset(worker)
            raise

    def _silence_hint(self, worker: _Worker) -> str:
        """What a timeout from a worker never heard from may also mean (VrollTimeoutError)."""
        if worker.ever_heard:
            return ""
        if worker._server_key is not None:
            return ("nothing ever came from this endpoint: also what a worker that does not allow this client's "
                    "CURVE key, or a wrong curve_server_key, looks like: CURVE refuses the handshake silently")
        return ("nothing ever came from this endpoint: also what a worker running CURVE looks like to a client "
                "without keys (curve_server_key, curve_client_keys), or no worker there")

    def _reset(self, worker: _Worker, linger_ms: int = 0) -> None:
        self._poller.unregister(worker.socket)
        worker.reset(linger_ms)
        self._poller.register(worker.socket, zmq.POLLIN)

    def _poll(self, timeout_s: float,
              iteration: bool = False) -> List[Tuple[_Worker, Dict[str, Any], List[bytes]]]:
        """Every message that arrives within timeout_s (returns at the first batch). Refused
        while a generate_iter iteration is open, unless it is that iteration's own poll: a
        reply of its requests read here would be dropped."""
        if self._iterating and not iteration:
            raise RuntimeError(_ITERATING_MESSAGE)
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        received = []
        for w in self._workers:
            if w.socket not in events:
                continue
            while True:
                try:
                    frames = w.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    header = protocol.decode(frames[0])
                except ValueError as exc:
                    raise VrollError(f"{w.endpoint}: malformed reply: {exc}") from None
                received.append((w, header, frames[1:]))
                w.ever_heard = True
        return received

    @staticmethod
    def _drop(worker: _Worker, header: Mapping[str, Any]) -> None:
        logger.debug("%s: dropping reply %s id=%r (no request waits for it)", worker.endpoint,
                     header.get("type"), header.get("id"))

    def _call(self, workers: Sequence[_Worker], make: Callable[[str], Dict[str, Any]],
              reply_type: str, request: str, timeout_s: Optional[float] = None,
              on_other: Optional[Callable[[_Worker, Dict[str, Any]], bool]] = None,
              update: bool = False,
              keepalive: bool = False,
              worker_timeouts: Optional[Dict[str, float]] = None
              ) -> Dict[str, Union[Dict[str, Any], Exception]]:
        """Sends make(id) to each worker and waits for each one's reply.

        Returns {endpoint: reply header | WorkerError | VrollTimeoutError | VrollError} in worker
        order; raises nothing itself. A worker that times out is reset. ``on_other`` sees every
        other message first and returns True when it consumed it. With ``update``, a worker's
        notice that a shutdown aborted the open update (_is_update_shutdown) is its reply.
        With ``keepalive`` (update messages that a worker acknowledges again when repeated), a
        worker whose reply says its update_timeout_ms is sent make(id) again every third of it
        while others are still awaited, so that its update stays open; an error answering one
        of those becomes the worker's result unless it already has an error.
        ``worker_timeouts`` ({endpoint: seconds}) replaces timeout_s for those workers.
        """
        if self._iterating:  # before anything is sent
            raise RuntimeError(_ITERATING_MESSAGE)
        timeout_s = self.timeout_s if timeout_s is None else _check_timeout("timeout_s", timeout_s)
        results: Dict[str, Union[Dict[str, Any], Exception]] = {}
        pending: Dict[str, _Worker] = {}
        for w in workers:
            id_ = self._next_id("c")
            try:
                self._send(w, make(id_), request=request)
                pending[id_] = w
            except VrollTimeoutError as exc:
                results[w.endpoint] = exc
                self._reset(w)
        worker_timeouts = worker_timeouts or {}
        start = time.monotonic()
        deadline_of = {w.endpoint: start + worker_timeouts.get(w.endpoint, timeout_s) for w in workers}
        keep_due: Dict[str, float] = {}  # endpoint -> when to send its next keep-alive
        keep_period: Dict[str, float] = {}
        keep_ids: Dict[str, _Worker] = {}  # keep-alives sent, by message id
        while pending:
            now = time.monotonic()
            for id_, w in list(pending.items()):
                if deadline_of[w.endpoint] <= now:
                    results[w.endpoint] = VrollTimeoutError(
                        w.endpoint, request, worker_timeouts.get(w.endpoint, timeout_s), self._silence_hint(w))
                    self._reset(w)
                    del pending[id_]
            if not pending:
                break
            remaining = min(deadline_of[w.endpoint] for w in pending.values()) - now
            for endpoint, due in list(keep_due.items()):
                if due > now:
                    continue
                w = self._by_endpoint[endpoint]
                id_ = self._next_id("k")
                try:
                    self._send(w, make(id_), request=request, block=False)
                    keep_ids[id_] = w
                except zmq.Again:
                    pass  # its queue is full of earlier messages: those keep the update too
                logger.debug("%s: %s repeated to keep it while other workers are awaited",
                             endpoint, request)
                keep_due[endpoint] = now + keep_period[endpoint]
            wait_s = min([remaining] + [due - now for due in keep_due.values()])
            for w, header, _ in self._poll(max(0.0, wait_s)):
                id_ = header.get("id")
                if keep_ids.get(id_) is w:
                    del keep_ids[id_]
                    if (header.get("type") == "error"
                            and not isinstance(results.get(w.endpoint), Exception)):
                        results[w.endpoint] = WorkerError.from_reply(w.endpoint, header, request)
                        keep_due.pop(w.endpoint, None)
                    continue
                if update and _is_update_shutdown(header):
                    # The worker aborted the update: that is its answer, also when its reply to
                    # this call came first (e.g. "begun", then the notice).
                    mine = [pid for pid, pw in pending.items() if pw is w]
                    if mine:
                        del pending[mine[0]]
                    if mine or w.endpoint in results:
                        results[w.endpoint] = WorkerError.from_reply(w.endpoint, header, request)
                        keep_due.pop(w.endpoint, None)
                        continue
                if pending.get(id_) is not w:
                    if on_other is None or not on_other(w, header):
                        self._drop(w, header)
                    continue
                del pending[id_]
                type_ = header.get("type")
                if type_ == "error":
                    results[w.endpoint] = WorkerError.from_reply(w.endpoint, header, request)
                elif type_ == reply_type:
                    results[w.endpoint] = header
                    period = _keepalive_period(header) if keepalive else None
                    if period is not None:
                        keep_period[w.endpoint] = period
                        keep_due[w.endpoint] = time.monotonic() + period
                else:
                    results[w.endpoint] = VrollError(
                        f"{w.endpoint}: expected {reply_type!r} in reply to {request}, got "
                        f"{type_!r}")
        return {w.endpoint: results[w.endpoint] for w in workers}

    def _control(self, type_: str, endpoints: Optional[Sequence[str]],
                 timeout_s: Optional[float]) -> Dict[str, Dict[str, Any]]:
        workers = self._select(endpoints)
        results = self._call(workers, lambda id_: protocol.make_control(type_, id_),
                             protocol.CONTROL_REPLIES[type_], type_, timeout_s)
        out = {}
        for endpoint, result in results.items():
            if isinstance(result, Exception):
                raise result
            out[endpoint] = {k: v for k, v in result.items() if k not in ("v", "type", "id")}
        return out

    # -----------------------------------------------------------------------------------------
    # Control.

    @_exclusive
    def health(self, endpoints: Optional[Sequence[str]] = None,
               timeout_s: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
        """{endpoint: health reply}: ``ok`` (bool), ``policy_version`` (int), ``model`` (map:
        vocab_size, max_seq_len, dim, n_layers, max_model_len: the longest prompt + output the
        worker runs, max_seq_len or less when its KV cache is too small, rope_layout:
        ``interleaved`` or ``half_split``, the q_proj/k_proj row order pushes must use),
        ``protocol_version``,
        ``paused`` (bool), ``update_version`` (the version of an update open there; 0: none),
        ``max_num_seqs`` (the largest n), ``kv_cache_dtype`` (``float32``, ``float16`` or
        ``bfloat16``: with 16 bits the logprobs are those of a model whose keys and values are
        rounded). The last two are absent from older workers.

        Args: endpoints: a subset of this client's (default all); timeout_s: overrides the
        client's for this call (a short one makes a liveness probe).
        Raises: WorkerError or VrollTimeoutError for the first worker (in endpoint order) that
        failed; the others' replies are lost then: probe one endpoint at a time to see them all.
        """
        return self._control("health", endpoints, timeout_s)

    @_exclusive
    def wait_ready(self, timeout_s: float = 120.0,
                   endpoints: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
        """Blocks until every worker answers ``health`` with ok true (e.g. after starting them);
        returns the health replies. A request sent before a worker is up waits in its socket's
        queue and is delivered when the connection is made, so one request per worker suffices.
        Raises VrollTimeoutError when a worker has not answered within timeout_s, VrollError
        when one answers ok false."""
        health = self.health(endpoints, timeout_s=timeout_s)
        for endpoint, reply in health.items():
            if not reply.get("ok", False):
                raise VrollError(f"{endpoint}: health reports ok = false: {reply}")
        return health

    @_exclusive
    def stats(self, endpoints: Optional[Sequence[str]] = None,
              timeout_s: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
        """{endpoint: engine stats} (num_running, num_waiting, blocks, prefix_hit_rate,
        tokens_per_second, policy_version, ...: docs/PROTOCOL.md). Errors as health()."""
        return self._control("stats", endpoints, timeout_s)

    @_exclusive
    def flush_cache(self, endpoints: Optional[Sequence[str]] = None,
                    timeout_s: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
        """Drops every unreferenced prefix-cache block on each worker. Errors as health()."""
        return self._control("flush_cache", endpoints, timeout_s)

    @_exclusive
    def pause(self, endpoints: Optional[Sequence[str]] = None,
              timeout_s: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
        """Stops the workers' engine steps (weight updates still apply). Errors as health()."""
        return self._control("pause", endpoints, timeout_s)

    @_exclusive
    def resume(self, endpoints: Optional[Sequence[str]] = None,
               timeout_s: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
        """Resumes paused workers. Errors as health()."""
        return self._control("resume", endpoints, timeout_s)

    @_exclusive
    def shutdown(self, endpoints: Optional[Sequence[str]] = None,
                 timeout_s: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
        """Asks the workers to exit after replying (unfinished samples end ``aborted``).
        Errors as health()."""
        return self._control("shutdown", endpoints, timeout_s)

    # -----------------------------------------------------------------------------------------
    # Generation.

    @_exclusive
    def generate(self, prompts: Union[Sequence[int], Sequence[Sequence[int]]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 n: Optional[int] = None, min_policy_version: int = 0,
                 endpoints: Optional[Sequence[str]] = None) -> List[RequestOutput]:
        """Generates n samples for each prompt on the workers; returns one RequestOutput per
        prompt, in the order of ``prompts``, each with its n samples in index order.

        Requests are spread over the workers, least loaded first (unfinished samples; ties in
        round-robin order), keeping up to ``max_in_flight`` samples at each; samples are
        collected as they stream back. A request a worker refuses as ``overloaded`` is re-sent
        (to any worker) for up to ``timeout_s``: to that worker as soon as one of this call's
        requests finishes there, keeping no more in flight there than it held when it refused,
        or else after a timed back-off.

        Args:
          prompts: token-id lists (ints, numpy ints fine), each non-empty and shorter than the
            worker's max_model_len (``health()``: the model's max_seq_len unless the worker's KV
            cache is too small for it); or one prompt as a flat list of ints, a 1-D numpy array
            or torch tensor (one output); a 2-D array: one prompt per row; vLLM's
            ``{"prompt_token_ids": [...]}`` in place of a prompt.
          sampling_params: one SamplingParams for all prompts, or one per prompt (default
            SamplingParams()).
          n: samples per prompt (a GRPO group), 1 <= n <= the worker's max_num_seqs; default:
            each prompt's ``SamplingParams.n``. Giving both, with a ``SamplingParams.n`` other
            than 1 that differs from ``n``, is a ValueError.
          min_policy_version: the workers start a request only once they run this version.
            Over several workers, each is asked its health first, and only those that run it
            (and are not paused) get requests, when any does (docs/SCALE_OUT.md). The wait has
            no limit of its own: a live worker is not silent (its liveness probes, every
            --heartbeat-ms, reset timeout_s when it is the longer), so a request for a version
            no push brings waits until it is aborted. generate_iter does not bound it either
            (its next() blocks until a group is done). To avoid an unbounded wait, check
            health()'s policy_version / update_version first, and push before generating.
          endpoints: spread over these of the client's workers only (default all), e.g. to
            leave out one that is down.
        Returns:
          list[RequestOutput]; a sample that failed inside the engine is returned with
          finish_reason ``error`` and its message in ``error``, not raised.
        Raises:
          TypeError / ValueError: a malformed or empty prompt or argument (nothing sent).
          WorkerError: a worker refused a request (e.g. ``bad_field`` with field ``prompt[3]``);
            the call's other unfinished requests are aborted on their workers.
          VrollTimeoutError: a worker with requests in flight stayed silent for timeout_s (every
            unfinished request is aborted, the silent worker's best effort on its old socket,
            which is then reset).
        """
        requests, workers = self._prepare_generate(prompts, sampling_params, n, min_policy_version,
                                                   endpoints)
        for _ in self._run_generate(requests, workers):
            pass
        return [self._request_output(r) for r in requests]

    def generate_iter(self, prompts: Union[Sequence[int], Sequence[Sequence[int]]],
                      sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                      n: Optional[int] = None, min_policy_version: int = 0,
                      endpoints: Optional[Sequence[str]] = None) -> Iterator[RequestOutput]:
        """generate(), yielding each prompt's RequestOutput as soon as all of its n samples have
        finished, in the order the groups complete (``RequestOutput.prompt_index`` says which
        prompt it is). For trainers that score groups while others still generate, or that stop
        once they have enough (e.g. dynamic sampling): leaving a ``for`` loop over it early
        (``break``, an exception) aborts this call's unfinished requests on their workers, so
        that their samples stop being computed; their results are dropped. An iterator kept in
        a variable is only left when it is closed: call its ``close()`` (or exhaust it).

        The arguments are checked when this is called (same errors as generate, nothing sent);
        requests are sent when the iteration starts. Time spent in the loop body between two
        outputs does not count towards ``timeout_s``. While the loop body runs, samples that
        finish wait in the client's socket (the workers go on generating up to
        ``max_in_flight`` samples each). The client is not thread-safe: do not call other
        methods of it from the loop body before the iteration has ended.

        Raises (from the iteration): as generate(), with the call's other unfinished requests
        aborted.
        """
        requests, workers = self._prepare_generate(prompts, sampling_params, n, min_policy_version,
                                                   endpoints)
        return (self._request_output(r) for r in self._run_generate(requests, workers))

    @staticmethod
    def _request_output(r: _PendingRequest) -> RequestOutput:
        return RequestOutput(r.request_id, list(r.header["prompt"]), list(r.samples),
                             r.worker.endpoint if r.worker else "", r.index)

    def _prepare_generate(self, prompts: Union[Sequence[int], Sequence[Sequence[int]]],
                          sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]],
                          n: Optional[int], min_policy_version: int,
                          endpoints: Optional[Sequence[str]]
                          ) -> Tuple[List[_PendingRequest], List[_Worker]]:
        """Checks generate's arguments and builds its requests (nothing is sent)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Mapping):
            raise TypeError("sampling_params is a dict: pass SamplingParams(**it) (or a list of "
                            "SamplingParams, one per prompt)")
        else:
            try:
                params = list(sampling_params)
            except TypeError:
                raise TypeError(f"sampling_params is a {type(sampling_params).__name__}: expected a "
                                "SamplingParams or a list of them, one per prompt") from None
            for i, sp in enumerate(params):
                if not isinstance(sp, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] is a {type(sp).__name__}, not a "
                                    "SamplingParams")
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if n is not None:
            n = _check_n(n, "n")
        min_policy_version = protocol.wire_int(min_policy_version, "min_policy_version", 0)
        workers = self._select(endpoints)

        requests: List[_PendingRequest] = []
        wire_cache: Dict[int, Dict[str, Any]] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            wire = wire_cache.get(id(sp))
            if wire is None:
                try:
                    wire = wire_cache[id(sp)] = sp.to_wire()
                except (TypeError, ValueError) as exc:
                    if isinstance(sampling_params, SamplingParams):
                        raise
                    raise type(exc)(f"sampling_params[{i}]: {exc}") from None
            sp_name = "sampling_params.n" if isinstance(sampling_params, SamplingParams) else f"sampling_params[{i}].n"
            sp_n = _check_n(sp.n, sp_name)
            if n is None:
                num_samples = sp_n
            else:
                if sp_n != 1 and sp_n != n:
                    raise ValueError(f"generate(n={n}) conflicts with {sp_name} = {sp.n!r}: give the "
                                     f"number of samples in one of them")
                num_samples = n
            rid = self._next_id("r")
            try:
                header = protocol.make_generate(rid, prompt, num_samples, wire, min_policy_version)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
            if not header["prompt"]:
                raise ValueError(f"prompts[{i}] is empty (a prompt needs at least one token)")
            requests.append(_PendingRequest(i, rid, header, num_samples, [None] * num_samples))
        return requests, workers

    def _run_generate(self, requests: List[_PendingRequest],
                      workers: List[_Worker]) -> Iterator[_PendingRequest]:
        """Sends `requests` and collects their samples, yielding each request once all of its
        samples are in. Leaving it early (GeneratorExit included) aborts what is unfinished."""
        if not requests:
            return
        self._enter("generate_iter")  # held until the iteration ends
        try:
            if self._iterating:
                raise RuntimeError(_ITERATING_MESSAGE)
            min_version = max(r.header.get("min_policy_version", 0) for r in requests)
            if min_version > 0 and len(workers) > 1:
                workers = self._workers_for_version(workers, min_version)
            self._iterating = True
            try:
                yield from self._collect(requests, workers)
            finally:
                self._iterating = False
        finally:
            self._leave()

    def _collect(self, requests: List[_PendingRequest],
                 workers: List[_Worker]) -> Iterator[_PendingRequest]:
        for w in self._workers:
            w.reset_generate()
        queue = collections.deque(requests)
        in_flight: Dict[str, _PendingRequest] = {}
        num_done = 0
        try:
            while num_done < len(requests):
                self._dispatch(workers, queue, in_flight)
                done = []
                for w, header, _ in self._poll(self._generate_wait_s(workers, queue),
                                               iteration=True):
                    request = self._on_generate_reply(w, header, queue, in_flight)
                    if request is not None:
                        done.append(request)
                self._check_silence(in_flight)
                suspended = 0.0
                for request in done:
                    num_done += 1
                    yielded_at = time.monotonic()
                    yield request
                    suspended += time.monotonic() - yielded_at
                # The caller's time between outputs is not the workers' silence: it moves each
                # worker's silence clock on by as much (not to now: a worker silent before it
                # stays as silent).
                for w in workers:
                    w.last_heard += suspended
        except BaseException:
            self._abort_requests(in_flight.values())
            raise

    def _dispatch(self, workers: Sequence[_Worker], queue: "collections.deque[_PendingRequest]",
                  in_flight: Dict[str, _PendingRequest]) -> None:
        """Sends queued requests while one of `workers` has room, least loaded first."""
        num_workers = len(self._workers)
        while queue:
            now = time.monotonic()
            for w in workers:
                if 0 < w.backoff_until <= now:
                    # The back-off ran out with none of ours finishing there: the worker may
                    # have room from other clients' requests; probe one request more.
                    w.backoff_until = 0.0
                    if w.request_limit is not None:
                        w.request_limit += 1
            n = queue[0].n
            candidates = [w for w in workers if now >= w.backoff_until and (
                w.request_limit is None or w.num_inflight_requests < w.request_limit) and (
                w.num_inflight_samples == 0 or w.num_inflight_samples + n <= self.max_in_flight)]
            if not candidates:
                return
            w = min(candidates, key=lambda c: (c.num_inflight_samples,
                                               (c.index - self._round_robin) % num_workers))
            self._round_robin = (w.index + 1) % num_workers
            request = queue.popleft()
            try:
                self._send(w, request.header, request=f"generate {request.request_id}")
            except VrollTimeoutError:
                self._reset(w)
                raise
            request.worker = w
            request.accepted = False
            in_flight[request.request_id] = request
            if w.num_inflight_requests == 0:
                w.last_heard = now
            w.num_inflight_requests += 1
            w.num_inflight_samples += request.n - request.num_received

    def _workers_for_version(self, workers: List[_Worker], version: int) -> List[_Worker]:
        """The workers a generate with min_policy_version `version` uses: asks each for its
        health, then keeps those that run `version` (or a later one) and are not paused, when
        any does; else all (they wait for the next push). A worker left out (one restarted from
        its initial weights, left out of a push, or still applying the push: only what runs
        counts, since an open update may never complete) would hold the requests until a push
        that the trainer, waiting for them, might not send. A worker that does not answer within
        _VERSION_CHECK_TIMEOUT_S is left out too when others qualify (else it is kept, and its
        requests time out as any); while it stays silent, later calls wait for it only
        _SILENT_RECHECK_S."""
        check_s = min(self.timeout_s, _VERSION_CHECK_TIMEOUT_S)
        results = self._call(workers, lambda id_: protocol.make_control("health", id_), "health",
                             "health", check_s,
                             worker_timeouts={w.endpoint: min(check_s, _SILENT_RECHECK_S)
                                              for w in workers if w.silent_at_version_check})
        ready = []
        for w in workers:
            result = results[w.endpoint]
            w.silent_at_version_check = isinstance(result, VrollTimeoutError)
            if isinstance(result, Exception):
                logger.info("%s: no health reply before generate (%s)", w.endpoint, result)
                continue
            if int(result.get("policy_version", 0)) >= version and not result.get("paused", False):
                ready.append(w)
        if not ready:
            return workers
        left_out = [w.endpoint for w in workers if w not in ready]
        if left_out:
            logger.info("min_policy_version %d: %s run it; %s left out", version,
                        [w.endpoint for w in ready], left_out)
        return ready

    def _generate_wait_s(self, workers: Sequence[_Worker],
                         queue: "collections.deque[_PendingRequest]") -> float:
        """How long the generate loop may block in poll: until the next back-off ends (when
        requests wait for one) or the next silence check."""
        wait = min(1.0, self.timeout_s)
        if queue:
            now = time.monotonic()
            backoffs = [w.backoff_until - now for w in workers if w.backoff_until > now]
            if backoffs:
                wait = min(wait, min(backoffs))
        return wait

    def _on_generate_reply(self, w: _Worker, header: Dict[str, Any],
                           queue: "collections.deque[_PendingRequest]",
                           in_flight: Dict[str, _PendingRequest]) -> Optional[_PendingRequest]:
        """Applies one reply to the generate state; returns the request it completed, if any."""
        request = in_flight.get(header.get("id"))
        if request is None or request.worker is not w:
            if header.get("type") == "health" and not header.get("id"):
                # The worker's liveness probe (every --heartbeat-ms while it holds requests of
                # this client) shows the process is alive, not that its engine progresses. It
                # counts only while every request of ours on that worker waits on a
                # min_policy_version above the worker's version (those make no progress by
                # design, e.g. the next version's rollouts queued during a training step longer
                # than timeout_s); a request that could run must answer within timeout_s, so a
                # paused or stuck engine is still noticed.
                version = header.get("policy_version", 0)
                mine = [r for r in in_flight.values() if r.worker is w]
                if mine and all(r.header.get("min_policy_version", 0) > version for r in mine):
                    w.last_heard = time.monotonic()
            self._drop(w, header)
            return None
        now = time.monotonic()
        w.last_heard = now
        type_ = header.get("type")
        if type_ == "accepted":
            request.accepted = True
            w.num_accepted_requests += 1
            w.num_overloaded = 0
            return None
        if type_ == "sample":
            output = CompletionOutput.from_reply(header)
            if not 0 <= output.index < request.n or request.samples[output.index] is not None:
                raise VrollError(f"{w.endpoint}: sample_index {output.index} of request "
                                 f"{request.request_id} (n = {request.n}) is out of range or "
                                 "repeated")
            request.samples[output.index] = output
            request.num_received += 1
            w.num_inflight_samples -= 1
            if request.num_received < request.n:
                return None
            del in_flight[request.request_id]
            w.num_inflight_requests -= 1
            if request.accepted:
                w.num_accepted_requests -= 1
            # A pending slot of the worker is free: retry at once what it refused.
            w.backoff_until = 0.0
            return request
        if type_ == "error":
            error = WorkerError.from_reply(w.endpoint, header, f"generate {request.request_id}")
            if error.code == "overloaded" and not request.accepted and request.num_received == 0:
                # Overload control. The worker holds all it takes (max_pending_requests): keep
                # no more in flight there than it holds of ours (at least one), and re-send when
                # one of ours finishes there; a timed back-off (doubling per refusal in a row,
                # up to _MAX_OVERLOAD_BACKOFF_S) covers slots held by other clients, and when it
                # runs out the limit grows by one (see _dispatch). Both last for this call.
                if request.first_overloaded_at is None:
                    request.first_overloaded_at = now
                elif now - request.first_overloaded_at > self.timeout_s:
                    raise error
                del in_flight[request.request_id]
                w.num_inflight_requests -= 1
                w.num_inflight_samples -= request.n
                w.request_limit = max(1, w.num_accepted_requests)
                w.num_overloaded += 1
                w.backoff_until = now + min(_MAX_OVERLOAD_BACKOFF_S,
                                            0.01 * 2 ** min(w.num_overloaded - 1, 7))  # 10 ms, 20 ms, ...
                request.worker = None
                queue.appendleft(request)
                return None
            raise error
        self._drop(w, header)
        return None

    def _check_silence(self, in_flight: Dict[str, _PendingRequest]) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.num_inflight_requests > 0 and now - w.last_heard > self.timeout_s:
                # A hung (not dead) worker still holds the requests: abort them on the old
                # socket, which lingers briefly to send the aborts, so that they do not keep
                # max_pending_requests slots or run later for nobody.
                stuck = [r for r in in_flight.values() if r.worker is w]
                self._abort_requests(stuck)
                self._reset(w, _SILENCE_ABORT_LINGER_MS)
                for r in stuck:
                    del in_flight[r.request_id]
                waiting = [int(r.header.get("min_policy_version", 0)) for r in stuck]
                waiting = [v for v in waiting if v > 0]
                version_note = (
                    f"; {len(waiting)} of them wait for min_policy_version >= {max(waiting)}, "
                    "which the worker may not have reached (health() says its policy_version): "
                    "such requests get no reply until it does, only liveness probes every "
                    "--heartbeat-ms" if waiting else "")
                raise VrollTimeoutError(
                    w.endpoint, f"generate ({len(stuck)} requests in flight; no sample of them "
                    "finished in that time: a worker busy with samples that take longer than "
                    "timeout_s (long max_tokens, large n: raise timeout_s above the slowest "
                    "sample's time), a dead, hung or paused one (health() says paused), or its "
                    "replies dropped at a full queue (the worker's log warns of that: "
                    "--max-queued-replies)"
                    f"{version_note})", self.timeout_s, self._silence_hint(w))

    def _abort_requests(self, requests: Any) -> None:
        """Best effort: tells each request's worker to end it; replies are dropped later."""
        for r in list(requests):
            if r.worker is None:
                continue
            try:
                r.worker.socket.send_multipart(
                    [protocol.encode(protocol.make_abort(r.request_id, self._next_id("a")))],
                    zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.warning("%s: could not abort %s: %s", r.worker.endpoint, r.request_id, exc)

    # -----------------------------------------------------------------------------------------
    # Weight updates.

    @_exclusive
    def push_weights(self, named_tensors: Mapping[str, Any], version: int, mode: str = "drain",
                     partial: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     endpoints: Optional[Sequence[str]] = None,
                     apply_timeout_s: Optional[float] = None,
                     busy_wait_s: float = 5.0,
                     rope_layout: Optional[str] = _DEFAULT_ROPE_LAYOUT,
                     base_version: Optional[int] = None) -> List[UpdateAck]:
        """Pushes new weights to the workers as one all-or-nothing update; returns each
        worker's ``applied`` acknowledgement, in endpoint order.

        Protocol: update_begin (manifest: name, dtype, shape, num_bytes, XXH3 checksum of the
        bytes as sent) -> update_chunk per chunk_bytes of each tensor (raw ZeroMQ frames, sent
        zero-copy from the tensors' memory) -> update_commit apply=false (each worker verifies)
        -> update_apply to all only when all verified. Any failure before apply sends
        update_abort to every worker: all keep their previous version. So does an interrupt
        (KeyboardInterrupt, re-raised once the aborts are acked or after 2 s). While it waits for a
        slow worker, it repeats the begin or the commit to the workers already done every third
        of their update_timeout_ms (a retry they acknowledge again), so that their update stays
        open until the apply.

        Args:
          named_tensors: {canonical name: torch.Tensor | numpy.ndarray}: float32, float16 or
            bfloat16 (sent as raw 2-byte words; the worker runs the values sent, so a trainer
            pushing bf16 copies of fp32 weights gets the logprobs of the rounded weights), any
            device (copied to CPU) and shape. Must not
            be modified until the call returns (bytes are sent from its memory). Entries named
            ``*.rotary_emb.inv_freq`` (RoPE buffers, in the state_dict() of older transformers
            versions) are left out, as the worker's Hugging Face loader and vLLM skip them:
            the worker computes them from rope_theta.
          version: the new policy version, an int in [1, 2**64 - 1) greater than every worker's
            current one.
          mode: what running sequences do at the swap: ``drain`` (finish under the old
            weights), ``abort``, ``restart`` or ``continue``.
          partial: True when named_tensors is a subset of the model's parameters. The update
            changes those on top of the weights each worker has, so they must all run the
            same version: it is checked (see base_version), and the workers' weights_checksums
            must agree with each other after the apply (the check against the local tensors is
            skipped: they are not all the weights).
          chunk_bytes: bytes per update_chunk frame (must fit the worker's max_message_bytes).
          endpoints: a subset of this client's workers (default all).
          apply_timeout_s: how long to wait for the ``applied`` acknowledgements (drain mode
            waits for running samples to finish); default timeout_s. An update sent to apply is
            in the worker's engine and cannot be withdrawn: a worker that has not acknowledged
            it in time still applies it at its safe point; the WeightUpdateError's ``pending``
            says so, from the worker's health.
          busy_wait_s: a worker that answers update_begin ``busy`` (another update is open or
            being applied there, e.g. one whose trainer just crashed and that the worker has not
            yet found gone) is asked again, with a back-off from 0.05 s to 1 s, for up to this
            long; 0: not at all. Workers that began meanwhile wait (well within their
            update_timeout_ms, 30 s by default).
          rope_layout: the RoPE layout the q_proj/k_proj rows of named_tensors are in,
            ``"interleaved"`` (llama2.c order, e.g. examples/python/vroll_llama.py) or
            ``"half_split"`` (Hugging Face order, e.g. a transformers model's state_dict()). A
            worker that loaded the other kind of checkpoint would compute garbage from these
            weights, passing every other check. Given, every worker's health must report the
            same, else ValueError, nothing sent; it is also sent in update_begin, where the
            worker checks it again (bad_field ``rope_layout``). Not given: ``"half_split"`` is
            sent in update_begin and checked there by the worker (a mismatch fails phase
            ``begin``, aborted everywhere, naming the layouts); workers older than the field
            are not checked. None: not checked anywhere.
          base_version: the version the update was made against (the trainer's last push).
            Sent in update_begin: a worker running any other version refuses it (phase
            ``begin``, bad_field ``base_version``, aborted everywhere). Partial updates
            default to the version every worker's health reports, and fail in phase
            ``version`` (nothing sent) when they differ, e.g. after a worker restarted from
            its initial weights: bring it up to date with ensure_weights and the full weights
            first. A partial update pushed to workers that all restarted would apply on top of
            their initial weights: pass base_version to rule that out. After a phase
            ``checksum`` failure of a partial update the workers run the same version number
            with different weights, which ensure_weights (it compares versions) cannot see:
            push the full weights as a new version.
        Returns:
          list[UpdateAck] with stage ``applied``, version == ``version`` and (full updates)
          weights_checksum == weights_checksum(named_tensors); for a worker whose model ties
          its head to its embedding, when named_tensors lists ``lm_head.weight`` as a copy of
          ``model.embed_tokens.weight`` (a tied Hugging Face model's state_dict() does; the
          worker checks the copy and uses the embedding), the checksum of named_tensors
          without it.
        Raises:
          TypeError / ValueError: a bad argument or tensor dtype (nothing sent).
          WeightUpdateError: ``phase`` says where (begin, stage, verify: aborted everywhere;
            apply, checksum: see ``applied`` and ``pending``; version: the workers of a partial
            update run different versions, nothing sent); ``failures`` names each failed
            worker's error. A worker that does not answer the health check made for
            rope_layout or a partial update's base version fails phase ``begin``.
        Cost: one XXH3 pass over the bytes as sent, one float32 conversion pass for the
        weights checksum (unless partial), and one send of every byte to every worker.
        """
        if isinstance(version, bool) or not isinstance(version, numbers.Integral):
            raise TypeError(f"version = {version!r} must be an int")
        version = int(version)  # numpy integers too
        if not 1 <= version < protocol.WIRE_INT_END - 1:
            raise ValueError(f"version = {version!r} must be in [1, 2**64 - 1) (initial "
                             "weights are 0; 2**64 - 1 is reserved: nothing could follow it)")
        if mode not in protocol.UPDATE_MODES:
            raise ValueError(f"mode = {mode!r}; one of {protocol.UPDATE_MODES}")
        if not named_tensors:
            raise ValueError("named_tensors is empty")
        rotary = [name for name in named_tensors if isinstance(name, str) and name.endswith(_ROTARY_BUFFER_SUFFIX)]
        if rotary:
            # Not parameters: the worker would refuse them as unknown names (helper-70).
            logger.debug("push_weights: leaving out %d RoPE buffer(s) (%s, ...)", len(rotary), rotary[0])
            named_tensors = {name: value for name, value in named_tensors.items() if name not in set(rotary)}
            if not named_tensors:
                raise ValueError("named_tensors holds only RoPE buffers (*.rotary_emb.inv_freq), no parameter")
        chunk_bytes = _check_int("chunk_bytes", chunk_bytes, 1)
        if apply_timeout_s is not None:  # checked here: at the apply, everything has been sent
            apply_timeout_s = _check_timeout("apply_timeout_s", apply_timeout_s)
        busy_wait_s = _check_seconds("busy_wait_s", busy_wait_s)
        if rope_layout not in (None, "interleaved", "half_split"):
            raise ValueError(f"rope_layout = {rope_layout!r}; one of None, 'interleaved', 'half_split'")
        rope_layout_defaulted = isinstance(rope_layout, _DefaultRopeLayout)
        rope_layout = str(rope_layout) if rope_layout is not None else None
        if base_version is not None:
            if isinstance(base_version, bool) or not isinstance(base_version, numbers.Integral):
                raise TypeError(f"base_version = {base_version!r} must be an int")
            base_version = int(base_version)
            if not 0 <= base_version < version:
                raise ValueError(f"base_version = {base_version} must be in [0, version = {version})")
        workers = self._select(endpoints)
        update_id = self._next_id("u")
        if (rope_layout is not None and not rope_layout_defaulted) or (partial and base_version is None):
            health = self._health_for_update(workers, version, update_id)
            if rope_layout is not None and not rope_layout_defaulted:
                self._check_rope_layout(health, rope_layout)
            if partial and base_version is None:
                base_version = self._common_version(health, version, update_id)
        tensors = [to_wire(name, named_tensors[name]) for name in sorted(named_tensors)]
        expected_checksums = set() if partial else _expected_weights_checksums(tensors, named_tensors)
        manifest = [protocol.make_manifest_entry(t.name, t.dtype, t.shape, t.num_bytes,
                                                 t.checksum) for t in tensors]

        def fail(phase: str, failures: Mapping[str, Exception],
                 timed_out: Sequence[str] = ()) -> WeightUpdateError:
            # A worker that is shutting down has aborted the update already (and may be gone).
            # One that timed out (also one whose failure names a chunk error: `timed_out`) was
            # reset: its abort is sent, but its ack is not awaited.
            silent = [w for w in workers if w.endpoint in timed_out
                      or isinstance(failures.get(w.endpoint), VrollTimeoutError)]
            for w in silent:
                try:
                    self._send(w, protocol.make_update_abort(update_id, self._next_id("c")),
                               block=False)
                except (zmq.Again, VrollError) as exc:
                    logger.info("%s: update_abort %s not sent: %s", w.endpoint, update_id, exc)
            self._abort_update([w for w in workers if w not in silent and not (
                isinstance(failures.get(w.endpoint), WorkerError)
                and failures[w.endpoint].code == "shutting_down")], update_id)
            note = ""
            if rope_layout_defaulted and any(isinstance(e, WorkerError) and e.field == "rope_layout"
                                             for e in failures.values()):
                note = _ROPE_LAYOUT_HINT
            return WeightUpdateError(version, update_id, phase, failures, note=note)

        # From the first update_begin until the apply is sent, an interruption (Ctrl-C) or an
        # unexpected error aborts the update on every worker, as failures do (fail()), so that
        # it does not stay open there, refusing other pushes as busy until update_timeout_ms.
        try:
            # Phase 0: every worker opens the update (checks the version, names, shapes, dtypes);
            # those that answer busy are asked again for up to busy_wait_s. Meanwhile the workers
            # that began are sent the same update_begin again (a retry: acked "begun", nothing
            # changes) every keep-alive period, so that their update_timeout_ms does not end it.
            def make_begin(id_: str) -> Dict[str, Any]:
                return protocol.make_update_begin(update_id, version, manifest, mode, partial, id_,
                                                  rope_layout, base_version)

            busy_deadline = time.monotonic() + max(0.0, busy_wait_s)
            backoff_s = 0.05
            begin_on = workers
            keep_period: Dict[str, float] = {}  # from each worker's begun ack
            keep_due: Dict[str, float] = {}
            failures: Dict[str, Exception] = {}

            def note_begun(results: Mapping[str, Any]) -> None:
                for endpoint, result in results.items():
                    if endpoint in failures:
                        continue
                    period = _keepalive_period(result)
                    if period is not None:
                        keep_period[endpoint] = period
                        keep_due[endpoint] = time.monotonic() + period

            while True:
                results = self._call(begin_on, make_begin, "update_ack", "update_begin", update=True,
                                     keepalive=True)
                failures = self._stage_failures(results, "begun")
                note_begun(results)
                busy = [ep for ep, e in failures.items()
                        if isinstance(e, WorkerError) and e.code == "busy"]
                if not failures or len(busy) < len(failures) or time.monotonic() >= busy_deadline:
                    break
                logger.info("update %s: busy on %s; asking again in %.2f s", update_id, busy, backoff_s)
                retry_at = min(time.monotonic() + backoff_s, busy_deadline)
                backoff_s = min(2 * backoff_s, 1.0)
                while True:  # wait for the retry, keeping the begun workers' update open
                    now = time.monotonic()
                    due = [self._by_endpoint[ep] for ep, t in keep_due.items() if t <= now]
                    if due:
                        kept = self._call(due, make_begin, "update_ack", "update_begin",
                                          update=True)
                        kept_failures = self._stage_failures(kept, "begun")
                        if kept_failures:
                            failures = {**failures, **kept_failures}
                            break
                        note_begun(kept)
                        continue
                    if now >= retry_at:
                        break
                    time.sleep(min([retry_at - now] + [t - now for t in keep_due.values()]))
                if any(ep not in busy for ep in failures):
                    break
                # The busy ones again, with the begun ones that take a repeated begin (their acks
                # said update_timeout_ms): the call keeps those open while it waits for the others.
                begin_on = [w for w in workers if w.endpoint in busy or w.endpoint in keep_period]
            if failures:
                raise fail("begin", failures)

            # Phase 1a: chunks, interleaved over the workers so that they stage in parallel.
            failures = self._send_chunks(workers, update_id, tensors, chunk_bytes)
            if failures:
                raise fail("stage", failures)

            # Phase 1b: every worker verifies (completeness, shapes, checksums) without applying.
            chunk_errors: Dict[str, Exception] = {}

            def on_chunk_error(w: _Worker, header: Dict[str, Any]) -> bool:
                return self._take_chunk_error(w, header, update_id, chunk_errors)

            # A worker that has verified waits for the others: its commit is repeated (a retry: acked
            # "verified" again) every keep-alive period, so that its update_timeout_ms does not end
            # the update before the apply, which would apply it on the other workers only.
            results = self._call(
                workers, lambda id_: protocol.make_update_commit(update_id, False, id_),
                "update_ack", "update_commit(apply=false)", on_other=on_chunk_error, update=True,
                keepalive=True)
            if chunk_errors:
                timed_out = [ep for ep, result in results.items()  # reset: not awaited for the abort
                             if isinstance(result, VrollTimeoutError)]
                for endpoint in timed_out:
                    chunk_errors.setdefault(endpoint, results[endpoint])
                # A worker's shutdown notice (its commit result here) says more than the errors of
                # the chunks it refused after it: its update is gone, no abort is needed.
                for endpoint, result in results.items():
                    if isinstance(result, WorkerError) and result.code == "shutting_down":
                        chunk_errors[endpoint] = result
                raise fail("stage", chunk_errors, timed_out)
            failures = self._stage_failures(results, "verified")
            if failures:
                raise fail("verify", failures)

            # Phase 2: all verified: apply everywhere.
            results = self._call(
                workers, lambda id_: protocol.make_update_apply(update_id, id_), "update_ack",
                "update_apply", apply_timeout_s, update=True)
        except VrollError:
            raise  # WeightUpdateError from fail(), which aborted the update
        except BaseException:
            self._abort_interrupted_update(workers, update_id)
            raise
        failures = self._stage_failures(results, "applied")
        acks = [UpdateAck.from_reply(ep, r) for ep, r in results.items() if ep not in failures]
        if failures:
            # Not awaited from a worker that timed out (reset) or is shutting down.
            self._abort_update([self._by_endpoint[ep] for ep, e in failures.items() if not (
                isinstance(e, VrollTimeoutError) or
                (isinstance(e, WorkerError) and e.code == "shutting_down"))], update_id)
            pending = self._apply_timeout_states(
                [ep for ep, e in failures.items() if isinstance(e, VrollTimeoutError)], version)
            raise WeightUpdateError(version, update_id, "apply", failures, acks, pending)

        for ack in acks:
            if ack.version != version:
                failures[ack.worker] = VrollError(
                    f"{ack.worker}: applied update reports version {ack.version}, not {version}")
            elif expected_checksums and ack.weights_checksum not in expected_checksums:
                reported = ("none" if ack.weights_checksum is None
                            else f"{ack.weights_checksum:#018x}")
                local = " or ".join(f"{c:#018x}" for c in sorted(expected_checksums))
                failures[ack.worker] = VrollError(
                    f"{ack.worker}: weights_checksum {reported} != local {local}")
        if partial and not failures and len({ack.weights_checksum for ack in acks}) > 1:
            # Same base version and same tensors, yet different weights: the workers did not
            # hold the same weights before (e.g. loaded from different checkpoints).
            by_checksum: Dict[Any, List[str]] = {}
            for ack in acks:
                by_checksum.setdefault(ack.weights_checksum, []).append(ack.worker)
            groups = "; ".join(f"{'none' if c is None else f'{c:#018x}'}: {', '.join(eps)}"
                               for c, eps in by_checksum.items())
            for ack in acks:
                failures[ack.worker] = VrollError(
                    f"{ack.worker}: after this partial update the workers' weights differ ({groups})")
        if failures:
            raise WeightUpdateError(version, update_id, "checksum", failures, acks)
        return acks

    def _health_for_update(self, workers: Sequence[_Worker], version: int,
                           update_id: str) -> Dict[str, Dict[str, Any]]:
        """Each worker's health reply, for push_weights' checks before anything is sent (one
        round, all workers at once: at most timeout_s however many are silent); a worker that
        does not answer fails the update in phase ``begin``, naming it (nothing was sent)."""
        try:
            return self.health([w.endpoint for w in workers])
        except (WorkerError, VrollTimeoutError) as exc:
            raise WeightUpdateError(version, update_id, "begin", {exc.worker: exc}) from None

    @staticmethod
    def _common_version(health: Mapping[str, Mapping[str, Any]], version: int, update_id: str) -> int:
        """The policy version every worker's health reports (a partial update's base), or
        WeightUpdateError phase ``version`` naming each worker's when they differ."""
        versions = {ep: int(h.get("policy_version", 0)) for ep, h in health.items()}
        if len(set(versions.values())) <= 1:
            return next(iter(versions.values()), 0)
        listed = ", ".join(f"{ep} runs {v}" for ep, v in versions.items())
        failures: Dict[str, Exception] = {
            ep: VrollError(
                f"{ep} runs version {v}; a partial update changes some parameters of the weights each "
                f"worker has, so all must run the same version ({listed}): bring them to one version "
                "with the full weights first (ensure_weights)")
            for ep, v in versions.items() if v != max(versions.values())}
        raise WeightUpdateError(version, update_id, "version", failures)

    def _apply_timeout_states(self, endpoints: Sequence[str], version: int) -> Dict[str, str]:
        """Where each worker whose ``update_apply`` timed out stands (WeightUpdateError.pending).
        Its engine has the update and applies it at its safe point (drain waits for the running
        samples), which no message can stop: it is asked for its health, briefly, to say so."""
        states: Dict[str, str] = {}
        for endpoint in endpoints:
            try:
                health = self.health([endpoint], timeout_s=min(self.timeout_s, _ABORT_TIMEOUT_S))[endpoint]
            except VrollError as e:
                states[endpoint] = f"unknown (no health reply: {e}); it may still apply version {version}"
                continue
            if health.get("policy_version", 0) >= version:
                states[endpoint] = f"applied it since (policy_version {health['policy_version']})"
            elif health.get("update_version") == version:
                states[endpoint] = (f"still on version {health.get('policy_version')}; applies version {version} "
                                    "at its next safe point (it cannot be withdrawn)")
            else:
                states[endpoint] = (f"on version {health.get('policy_version')} with no update to {version} "
                                    "open: it will not apply it")
        return states

    @staticmethod
    def _check_rope_layout(health: Mapping[str, Mapping[str, Any]], rope_layout: str) -> None:
        """ValueError unless every worker's health reply reports `rope_layout` (push_weights)."""
        for endpoint, reply in health.items():
            layout = (reply.get("model") or {}).get("rope_layout")
            if layout is None:
                raise ValueError(f"{endpoint}: its health reply names no rope_layout (an older worker), so "
                                 f"rope_layout = {rope_layout!r} cannot be checked; nothing sent")
            if layout != rope_layout:
                raise ValueError(
                    f"{endpoint}: the worker's model uses {layout} RoPE, but these weights are given as "
                    f"rope_layout = {rope_layout!r}: it would read their q_proj/k_proj rows in the wrong "
                    "order and compute garbage (docs/PROTOCOL.md, Weight updates); nothing sent")

    @staticmethod
    def _stage_failures(results: Mapping[str, Any], stage: str) -> Dict[str, Exception]:
        failures: Dict[str, Exception] = {}
        for endpoint, result in results.items():
            if isinstance(result, Exception):
                failures[endpoint] = result
            elif result.get("stage") != stage:
                failures[endpoint] = VrollError(
                    f"{endpoint}: update_ack stage {result.get('stage')!r}, expected {stage!r}")
        return failures

    @staticmethod
    def _take_chunk_error(w: _Worker, header: Mapping[str, Any], update_id: str,
                          errors: Dict[str, Exception]) -> bool:
        """Records an ``error`` answering one of this update's chunks, or the worker's notice that
        a shutdown aborted the update (first per worker)."""
        id_ = header.get("id") or ""
        if header.get("type") != "error" or not (id_.startswith(update_id + ".")
                                                 or _is_update_shutdown(header)):
            return False
        error = WorkerError.from_reply(w.endpoint, header, "update_chunk")
        if _is_update_shutdown(header):
            errors[w.endpoint] = error  # it says more than a chunk error: no abort is needed
        else:
            errors.setdefault(w.endpoint, error)
        return True

    def _send_chunks(self, workers: Sequence[_Worker], update_id: str,
                     tensors: Sequence[WireTensor], chunk_bytes: int) -> Dict[str, Exception]:
        """Sends every chunk of every tensor to every worker; stops at the first chunk error
        (checked between batches of chunks) or send timeout. Returns {endpoint: error}."""
        errors: Dict[str, Exception] = {}
        sequence = itertools.count()
        since_check = 0

        def take_errors(timeout_s: float) -> None:
            for w, header, _ in self._poll(timeout_s):
                if not self._take_chunk_error(w, header, update_id, errors):
                    self._drop(w, header)

        for tensor in tensors:
            for offset, length in chunk_ranges(tensor.num_bytes, chunk_bytes):
                payload = tensor.data[offset:offset + length]
                for w in workers:
                    header = protocol.make_update_chunk(update_id, tensor.name, offset,
                                                        f"{update_id}.{next(sequence)}")
                    # Not blocking: while the worker does not take more (its queue is full, or
                    # it is gone), its replies are read, so that an error it sent (a poisoned
                    # chunk, the shutdown notice) ends the push now, not after timeout_s.
                    deadline = time.monotonic() + self.timeout_s
                    while True:
                        try:
                            self._send(w, header, [payload], request=f"update_chunk {tensor.name}",
                                       block=False)
                            break
                        except zmq.Again:
                            pass
                        # Wake when the worker takes more or says something.
                        waiting = zmq.Poller()
                        waiting.register(w.socket, zmq.POLLIN | zmq.POLLOUT)
                        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                        if dict(waiting.poll(min(left_ms, 1000))).get(w.socket, 0) & zmq.POLLIN:
                            take_errors(0)
                        if errors:
                            return errors
                        if time.monotonic() >= deadline:
                            self._reset(w)
                            errors[w.endpoint] = VrollTimeoutError(
                                w.endpoint, f"sending update_chunk {tensor.name}", self.timeout_s)
                            return errors
                since_check += 1
                if since_check >= _CHUNKS_PER_ERROR_CHECK:
                    since_check = 0
                    take_errors(0)
                    if errors:
                        return errors
        return errors

    def _abort_update(self, workers: Sequence[_Worker], update_id: str,
                      timeout_s: float = _ABORT_TIMEOUT_S) -> None:
        """update_abort to each worker, waiting briefly for the acks; errors (an update the
        worker never opened) are expected and only logged."""
        results = self._call(workers, lambda id_: protocol.make_update_abort(update_id, id_),
                             "update_ack", "update_abort", min(self.timeout_s, timeout_s),
                             on_other=lambda w, h: (h.get("id") or "").startswith(update_id + "."))
        for endpoint, result in results.items():
            if isinstance(result, Exception):
                logger.info("%s: update_abort %s: %s", endpoint, update_id, result)

    def _abort_interrupted_update(self, workers: Sequence[_Worker], update_id: str) -> None:
        """push_weights interrupted (Ctrl-C) or failing unexpectedly: update_abort everywhere,
        waiting at most _INTERRUPT_ABORT_TIMEOUT_S for the acks; a second interruption ends the
        wait. A worker whose socket was reset (a chunk cut short, _send) refuses the abort from
        the new one, and drops the update at the next update_begin from anyone instead. An
        update already being applied can no longer be aborted (its worker says so)."""
        logger.warning("update %s interrupted: aborting it on %s", update_id,
                       ", ".join(w.endpoint for w in workers))
        try:
            self._abort_update(workers, update_id, _INTERRUPT_ABORT_TIMEOUT_S)
        except BaseException as exc:  # a second Ctrl-C
            logger.warning("update %s: update_abort cut short: %r", update_id, exc)

    @_exclusive
    def ensure_weights(self, named_tensors: Mapping[str, Any], version: int, mode: str = "drain",
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                       endpoints: Optional[Sequence[str]] = None,
                       rope_layout: Optional[str] = _DEFAULT_ROPE_LAYOUT) -> List[UpdateAck]:
        """Brings every worker to ``version``: asks each for its health and pushes the full
        weights (one two-phase update among the stale ones) to those that report an older
        version, e.g. a worker restarted from its initial weights (version 0).

        Call it after a WorkerError/VrollTimeoutError from a worker, or before each round of
        generation, to resume after a worker restart. A no-op (returns []) when all are current
        (version 0, the initial weights, included: a restarted worker already has them); a
        worker on a newer version is an error, for version 0 too (see Raises).
        rope_layout: as push_weights (default Hugging Face order; checked on the workers that are
        pushed to).
        Returns: the applied UpdateAcks of the workers that were updated.
        Raises: VrollTimeoutError/WorkerError from health (a worker still down);
        WeightUpdateError with phase ``version`` when a worker runs a *newer* version than
        ``version`` (the trainer's state is behind: nothing is sent), or as push_weights.
        """
        workers = self._select(endpoints)
        health = self.health([w.endpoint for w in workers])
        stale = [ep for ep, h in health.items() if int(h.get("policy_version", 0)) < version]
        newer = {ep: VrollError(f"{ep} runs version {h.get('policy_version')}, newer than "
                                f"{version}")
                 for ep, h in health.items() if int(h.get("policy_version", 0)) > version}
        if newer:
            raise WeightUpdateError(version, "", "version", newer)
        if not stale:
            return []
        logger.info("ensure_weights: pushing version %d to %s", version, stale)
        return self.push_weights(named_tensors, version, mode=mode, partial=False,
                                 chunk_bytes=chunk_bytes, endpoints=stale, rope_layout=rope_layout)
