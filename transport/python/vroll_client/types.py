"""The client's value types: sampling parameters, outputs, update acknowledgements, errors."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from . import protocol


@dataclass
class SamplingParams:
    """Per-request sampling parameters (the vLLM ``SamplingParams`` subset an RL trainer needs).

    Attributes:
      temperature: softmax temperature, >= 0; 0 is greedy (argmax, lowest id on ties).
      top_p: nucleus mass in (0, 1]; 1 disables it. Applied after top_k, to the renormalized
        probabilities, as vLLM does.
      top_k: keep the k most likely tokens; 0 (or -1 or None, vLLM's values) disables it.
        Tokens of exactly equal probability rank by lower id, so exactly k are kept (vLLM keeps
        every token tied with the k-th); the nucleus of top_p is cut the same way.
      max_tokens: generated tokens per sample, >= 1 (the protocol's ``max_new_tokens``); None,
        as in vLLM: until the context is full (finish reason ``length`` there).
      stop_token_ids: generating one of these ends the sample with finish reason ``stop``
        (None: none, as vLLM's default).
      include_stop_token: whether the stop token (and its logprob) is part of the output.
      seed: seed of the request's generators (sample i draws from stream (seed, i)); None lets
        the worker draw one.
      n: samples per prompt (a GRPO group), as in vLLM; or ``generate(..., n=k)`` (a value
        other than 1 here that differs from that k is a ValueError).
      logprobs: vLLM's option, accepted as None or 0 only, for code ported from vLLM: every
        sample always carries its sampled tokens' logprobs (``CompletionOutput.logprobs``), which
        is what vLLM's 0 returns; the N most likely tokens' logprobs per position (vLLM's N >= 1)
        are not computed, so N >= 1 is a ValueError at construction.
      stop: vLLM's stop strings, accepted as None or empty only: vroll works on token ids and
        never detokenizes, so strings are a ValueError at construction; use ``stop_token_ids``.
      ignore_eos: vLLM's option, accepted as None or True only: no token is implied to end a
        sample here (what vLLM's ignore_eos=True does); False, vLLM's stop at EOS, is a
        ValueError at construction: list the EOS id in ``stop_token_ids``.
    Other vLLM options (penalties, min_p, min_tokens, best_of, prompt_logprobs, detokenize, ...)
    are not fields: passing one is Python's TypeError "unexpected keyword argument".
    The client checks types and the ranges above when a request is made (to_wire: TypeError or
    ValueError naming ``sampling.<field>``, nothing sent), with the worker's rules: temperature
    0 or finite and >= 1e-5 (vLLM takes a smaller one as greedy: pass 0), top_p in (0, 1],
    top_k >= -1, max_tokens >= 1. The worker checks again (a stop token id outside the
    vocabulary, n above its max_num_seqs) and answers a bad value with error ``bad_field``
    naming ``sampling.<field>`` by its wire name (docs/PROTOCOL.md): ``max_tokens`` travels as
    ``max_new_tokens``.

    Unlike vLLM, no token ends a sample unless it is in ``stop_token_ids``: the end-of-sequence
    token is not implied (vLLM stops at EOS unless ``ignore_eos``). Pass the model's: for the
    llama2.c story models (stories260K) ``[1, 2]``, since they end a story by starting the next
    one with BOS = 1 (EOS = 2); for a Hugging Face model ``eos_token_id`` of its config.json.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = 0
    max_tokens: Optional[int] = 16
    stop_token_ids: Optional[List[int]] = field(default_factory=list)
    include_stop_token: bool = True
    seed: Optional[int] = None
    n: int = 1
    logprobs: Optional[int] = None
    stop: Optional[Any] = None
    ignore_eos: Optional[bool] = None

    def __post_init__(self) -> None:
        # vLLM options a ported trainer may pass, which have no equivalent here: refused at once,
        # saying what to do instead (rather than silently ignored).
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, numbers.Integral)):
            raise TypeError(f"SamplingParams.logprobs = {self.logprobs!r} must be None or an int")
        if self.logprobs is not None and self.logprobs != 0:
            raise ValueError(
                f"SamplingParams.logprobs = {self.logprobs}: vroll does not compute the {self.logprobs} most likely "
                "tokens' logprobs per position; every sample carries the logprob of each token it sampled "
                "(CompletionOutput.logprobs), as vLLM's logprobs=0 does: pass None or 0")
        if self.ignore_eos is not None and not self.ignore_eos:
            raise ValueError(
                "SamplingParams.ignore_eos = False: no token ends a sample here unless it is in stop_token_ids "
                "(vroll does not know the model's EOS): pass stop_token_ids=[eos_token_id] to stop at it")
        if self.stop is not None and (isinstance(self.stop, str) or len(self.stop) > 0):
            raise ValueError(
                f"SamplingParams.stop = {self.stop!r}: vroll works on token ids and does not detokenize, so it "
                "cannot match stop strings; pass the ids that end a sample as stop_token_ids")

    def to_wire(self) -> Dict[str, Any]:
        """The protocol's ``sampling`` map (``n`` travels beside it, in the ``generate`` header).

        Raises (naming the field, e.g. ``sampling.max_tokens = '5' must be an int``):
          TypeError: temperature or top_p not a number; top_k, max_tokens, seed or a stop token
            id not an int (Python or numpy numbers are fine; bool is neither).
          ValueError: an int msgpack cannot carry (seed outside [0, 2**64), top_k or max_tokens
            outside [-2**63, 2**64)); a value outside the ranges of the class docstring.
          TypeError: include_stop_token not a bool (0 and 1 are accepted; a string such as
            "false" is not: it would have been true).
        """
        wire: Dict[str, Any] = {
            "temperature": protocol.wire_float(self.temperature, "sampling.temperature"),
            "top_p": protocol.wire_float(self.top_p, "sampling.top_p"),
            "top_k": _wire_top_k(self.top_k),
            "max_new_tokens": (_MAX_NEW_TOKENS_UNBOUNDED if self.max_tokens is None
                               else protocol.wire_int(self.max_tokens, "sampling.max_tokens")),
            "stop_token_ids": protocol._token_ids([] if self.stop_token_ids is None else self.stop_token_ids,
                                                  "sampling.stop_token_ids"),
            "include_stop_token": _wire_bool(self.include_stop_token, "sampling.include_stop_token"),
        }
        if self.seed is not None:
            wire["seed"] = protocol.wire_int(self.seed, "sampling.seed", 0)
        # The worker's rules (rollout/sampling_params.h), checked before anything is sent.
        t = wire["temperature"]
        if not (t == 0 or (math.isfinite(t) and t >= MIN_TEMPERATURE)):
            raise ValueError(f"sampling.temperature = {self.temperature!r} must be 0 (greedy) or finite and "
                             f">= {MIN_TEMPERATURE} (vLLM takes a smaller one as greedy: pass 0)")
        if not 0 < wire["top_p"] <= 1:
            raise ValueError(f"sampling.top_p = {self.top_p!r} must be in (0, 1] (1: disabled)")
        if wire["top_k"] < 0:
            raise ValueError(f"sampling.top_k = {self.top_k!r} must be >= -1 (-1, 0 or None: disabled)")
        if wire["max_new_tokens"] < 1:
            raise ValueError(f"sampling.max_tokens = {self.max_tokens!r} must be >= 1 (None: until the context "
                             "is full)")
        return wire


#: The smallest temperature above 0 the workers take (rollout/sampling_params.h kMinTemperature):
#: below it, logits / temperature may overflow float32.
MIN_TEMPERATURE = 1e-5


#: max_new_tokens sent for max_tokens=None: the protocol's largest, so the context bounds it.
_MAX_NEW_TOKENS_UNBOUNDED = 2 ** 31 - 1


def _wire_top_k(value: Any) -> int:
    """top_k for the wire: -1 and None, vLLM's "disabled", become the protocol's 0."""
    if value is None:
        return 0
    top_k = protocol.wire_int(value, "sampling.top_k")
    return 0 if top_k == -1 else top_k


def _wire_bool(value: Any, what: str) -> bool:
    """value as a bool: a bool (numpy's too) or an int 0 or 1; TypeError naming `what` else."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_, without numpy
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{what} = {value!r} must be a bool")


@dataclass
class CompletionOutput:
    """One sample of a request (the protocol's ``sample`` reply).

    Attributes:
      index: sample index in [0, n).
      token_ids: generated token ids.
      logprobs: per generated token, log_softmax(logits / temperature)[token] before top-k/top-p
        under the policy that produced it (temperature 0: of the raw logits).
      finish_reason: ``stop``, ``length``, ``aborted`` or ``error``.
      policy_version: the version that produced the tokens (the last span's when mixed); with no
        token (stop token not included, aborted before the first one), the version in use when
        the sample finished.
      version_spans: [(begin, end, version)]: tokens [begin, end) came from ``version``.
      num_prompt_tokens, num_cached_prompt_tokens: prompt length and how much of it came from
        the prefix cache.
      num_preemptions: times the sequence was preempted (recomputed).
      queue_ms, first_token_ms, total_ms: milliseconds from acceptance.
      error: the worker's message when finish_reason is ``error``, else None.
    Unlike vLLM's, ``logprobs`` is a flat list of floats (one per token, the sampled token's),
    not a list of {token_id: Logprob} dicts, and there is no ``text`` (vroll never detokenizes);
    ``cumulative_logprob`` is their sum, as vLLM's.
    """

    index: int
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str
    policy_version: int
    version_spans: List[Tuple[int, int, int]]
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    queue_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0
    error: Optional[str] = None

    @property
    def cumulative_logprob(self) -> float:
        """Sum of ``logprobs`` (vLLM's field of the same name): the sample's log-probability
        under the behavior policy at its temperature."""
        return math.fsum(self.logprobs)

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> "CompletionOutput":
        """Builds one from a ``sample`` reply; missing optional fields take their defaults."""
        return cls(
            index=int(reply["sample_index"]),
            token_ids=[int(t) for t in reply.get("output_ids", [])],
            logprobs=[float(x) for x in reply.get("logprobs", [])],
            finish_reason=str(reply.get("finish_reason", "")),
            policy_version=int(reply.get("policy_version", 0)),
            version_spans=[(int(b), int(e), int(v)) for b, e, v in reply.get("version_spans", [])],
            num_prompt_tokens=int(reply.get("num_prompt_tokens", 0)),
            num_cached_prompt_tokens=int(reply.get("num_cached_prompt_tokens", 0)),
            num_preemptions=int(reply.get("num_preemptions", 0)),
            queue_ms=float(reply.get("queue_ms", 0.0)),
            first_token_ms=float(reply.get("first_token_ms", 0.0)),
            total_ms=float(reply.get("total_ms", 0.0)),
            error=reply.get("error") or None,
        )


@dataclass
class RequestOutput:
    """The result of one prompt: its n samples, in sample-index order.

    Attributes:
      request_id: the id the client gave the request (unique per client).
      prompt_token_ids: the prompt as sent.
      outputs: n CompletionOutputs, ``outputs[i].index == i``.
      worker: the endpoint of the worker that generated it.
      prompt_index: the position of its prompt in the ``prompts`` of the generate call.
    """

    request_id: str
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    worker: str = ""
    prompt_index: int = 0

    @property
    def finished(self) -> bool:
        """Always True (vLLM's field): generate and generate_iter return a prompt's output only
        once all of its samples have finished (an aborted or failed one included)."""
        return True


@dataclass
class UpdateAck:
    """A worker's ``update_ack`` for an applied (or otherwise acknowledged) weight update.

    Attributes:
      worker: endpoint of the worker.
      update_id, stage: the update and the stage acknowledged (``applied`` from push_weights).
      version: the policy version now in use.
      weights_checksum: WeightsChecksum of every weight now in use (``applied`` only).
      num_drained, num_aborted, num_restarted, num_recomputed: sequences affected by the swap.
      wait_ms: apply request -> swap (waiting for the safe point, e.g. draining).
      stall_ms: time generation was paused for the swap.
    """

    worker: str
    update_id: str
    stage: str
    version: int
    weights_checksum: Optional[int] = None
    num_drained: int = 0
    num_aborted: int = 0
    num_restarted: int = 0
    num_recomputed: int = 0
    wait_ms: float = 0.0
    stall_ms: float = 0.0

    @classmethod
    def from_reply(cls, worker: str, reply: Mapping[str, Any]) -> "UpdateAck":
        checksum = reply.get("weights_checksum")
        return cls(
            worker=worker,
            update_id=str(reply.get("update_id", "")),
            stage=str(reply.get("stage", "")),
            version=int(reply.get("version", 0)),
            weights_checksum=None if checksum is None else int(checksum),
            num_drained=int(reply.get("num_drained", 0)),
            num_aborted=int(reply.get("num_aborted", 0)),
            num_restarted=int(reply.get("num_restarted", 0)),
            num_recomputed=int(reply.get("num_recomputed", 0)),
            wait_ms=float(reply.get("wait_ms", 0.0)),
            stall_ms=float(reply.get("stall_ms", 0.0)),
        )


# ---------------------------------------------------------------------------------------------
# Errors.


class VrollError(Exception):
    """Base class of every error this package raises (besides TypeError/ValueError for a
    caller's bad argument)."""


class WorkerError(VrollError):
    """A worker answered a request with an ``error`` reply.

    Attributes: worker (endpoint), code (``bad_field``, ``overloaded``, ``update_failed``, ...,
    see docs/PROTOCOL.md), field (the offending field, or ""), message, request (what the client
    asked: e.g. ``generate r3`` or ``update_begin``), tensor (an ``update_failed`` about one
    tensor: its name, e.g. the tensor whose checksum did not match; else "").
    """

    def __init__(self, worker: str, code: str, field: str, message: str, request: str = "",
                 tensor: str = ""):
        self.worker = worker
        self.code = code
        self.field = field
        self.message = message
        self.request = request
        self.tensor = tensor
        where = f" ({field})" if field else ""
        what = f" to {request}" if request else ""
        super().__init__(f"{worker}: error {code}{where}{what}: {message}")

    @classmethod
    def from_reply(cls, worker: str, reply: Mapping[str, Any], request: str = "") -> "WorkerError":
        return cls(worker, str(reply.get("code", "")), str(reply.get("field", "") or ""),
                   str(reply.get("message", "")), request, str(reply.get("tensor", "") or ""))


class VrollTimeoutError(VrollError, TimeoutError):
    """A worker owed a reply and sent nothing for ``timeout_s`` seconds (dead, hung, unreachable
    or overloaded), or a send could not be queued for as long. Attributes: worker, request."""

    def __init__(self, worker: str, request: str, timeout_s: float, hint: str = ""):
        self.worker = worker
        self.request = request
        self.timeout_s = timeout_s
        super().__init__(f"{worker}: no reply to {request} for {timeout_s:g} s" + (f" ({hint})" if hint else ""))


class WeightUpdateError(VrollError):
    """A weight update failed.

    Attributes:
      version, update_id: the update.
      phase: where it failed: ``begin`` (manifest refused), ``stage`` (a chunk refused or a send
        timed out), ``verify`` (the commit check), ``apply`` (after every worker verified: some
        workers may have applied it, see ``applied``), ``checksum`` (applied, but a worker's
        weights_checksum differs from the local one) or ``version`` (ensure_weights found a
        worker running a newer version than the trainer's).
      failures: {endpoint: WorkerError | VrollTimeoutError | VrollError} for each failed worker.
      applied: UpdateAcks of workers that applied the update (phases ``apply``, ``checksum``);
        empty otherwise: in phases begin/stage/verify every worker was sent ``update_abort`` and
        keeps its previous version.
      pending: phase ``apply``: {endpoint: state} for each worker whose ``applied``
        acknowledgement did not come within apply_timeout_s. Such a worker has the update in its
        engine and applies it at its safe point all the same (no message withdraws it); the
        state, read from its health when the error was raised, says whether it has applied it
        since, still will, or cannot be reached. Empty otherwise.
    """

    def __init__(self, version: int, update_id: str, phase: str,
                 failures: Mapping[str, Exception], applied: Sequence[UpdateAck] = (),
                 pending: Optional[Mapping[str, str]] = None, note: str = ""):
        self.version = version
        self.update_id = update_id
        self.phase = phase
        self.failures = dict(failures)
        self.applied = list(applied)
        self.pending = dict(pending or {})
        causes = "; ".join(str(exc) for exc in self.failures.values())
        if phase in ("apply", "checksum"):
            outcome = f"{len(self.applied)} worker(s) acknowledged applying it"
            if self.pending:
                outcome += "; not acknowledged in time: " + "; ".join(
                    f"{endpoint} {state}" for endpoint, state in self.pending.items())
        elif phase == "version":
            outcome = "nothing sent"
        else:
            outcome = "aborted on every worker, versions unchanged"
        named = f"weight update {update_id} " if update_id else "weight update "
        super().__init__(f"{named}(version {version}) failed at {phase} on "
                         f"{', '.join(self.failures)}: {causes} [{outcome}]" + (f". {note}" if note else ""))
