"""A scripted in-process stand-in for vroll-worker, for testing the client's logic (ordering,
retries, error handling, the two-phase update) without a model.

It speaks the wire protocol of docs/PROTOCOL.md on a ROUTER socket owned by its own thread, and
reimplements the worker side of weight updates independently of vroll_client: it reassembles
chunk bytes, checks coverage and XXH3 checksums, converts fp16/bf16 to fp32 with numpy and
computes WeightsChecksum itself. Samples are a deterministic function of the request
(see expected_tokens), so tests can check every token.
"""
from __future__ import annotations

import struct
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import msgpack
import numpy as np
import xxhash
import zmq


def expected_tokens(prompt: List[int], index: int, max_new_tokens: int, vocab_size: int) -> List[int]:
    """The fake's output for sample `index` of a request with this prompt."""
    return [(prompt[-1] + 7 * index + k + 1) % vocab_size for k in range(max_new_tokens)]


def reference_weights_checksum(weights: Dict[str, np.ndarray]) -> int:
    """WeightsChecksum over fp32 arrays, written from policy/weight_update.h independently of
    vroll_client.weights (one shot over the concatenated stream of per-tensor digests)."""
    stream = bytearray()
    for name in sorted(weights, key=lambda s: s.encode()):
        data = np.ascontiguousarray(weights[name], dtype="<f4").tobytes()
        stream += struct.pack("<Q", len(name.encode())) + name.encode()
        stream += struct.pack("<Q", len(data)) + struct.pack("<Q", xxhash.xxh3_64_intdigest(data))
    return xxhash.xxh3_64_intdigest(bytes(stream))


def _to_float32(dtype: str, raw: bytes, shape: List[int]) -> np.ndarray:
    if dtype == "float32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape)
    if dtype == "float16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(shape)
    assert dtype == "bfloat16", dtype
    words = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return words.view(np.float32).reshape(shape)


class FakeWorker:
    """Binds `endpoint` (default tcp://127.0.0.1:<ephemeral>) and serves until stop().

    Knobs (set before the client sends; read by the worker thread):
      params: {name: shape} of the model (update manifests are checked against it).
      vocab_size: prompts and stop ids must be in [0, vocab_size).
      num_overloaded: the next this-many generate requests are refused as ``overloaded``.
      max_pending: when > 0, hold accepted requests like an engine: their samples are sent
        one request at a time, oldest first, each time the socket has been idle for 1 ms, and a
        generate arriving while max_pending are held is refused as ``overloaded`` (as the
        worker's max_pending_requests does).
      silent: never answer generate.
      hang_after_accept: answer generate with ``accepted`` only, never with its samples (a hung
        engine).
      reverse: hold samples until the socket is idle, then send them newest first.
      gate_min_policy_version: a generate whose min_policy_version is above ``version`` is
        accepted and never answered (as a worker waiting for a push that does not come).
      silent_health: never answer health (a stopped worker, as far as a health check can tell).
      update_version, paused: reported by health (the version of an open update, 0: none;
        whether the worker is paused: it still answers here).
      delay_with_probes_s: hold each accepted request's samples this long (a request waiting on
        a min_policy_version), sending its client a liveness probe (a health reply with an empty
        id, as the worker's heartbeat_ms probe) every 0.1 s meanwhile.
      fail_verify: commit answers ``update_failed`` (as a real checksum mismatch would).
      verify_delay_s: the first commit of an update is answered this much later (a worker slow to
        verify; the fake answers nothing else meanwhile).
      bad_checksum: the applied ack reports a wrong weights_checksum.
    curve_secret_key (constructor): serve with CURVE on (any client key is admitted).
    Observations: received (list of (type, header)), version, weights ({name: fp32 array}),
    num_refused_overloaded (generate requests refused as ``overloaded``).
    """

    def __init__(self, params: Dict[str, List[int]], vocab_size: int = 64,
                 curve_secret_key: Optional[bytes] = None, endpoint: Optional[str] = None):
        self._bind = endpoint
        self._curve_secret_key = curve_secret_key
        self.params = {k: list(v) for k, v in params.items()}
        self.vocab_size = vocab_size
        self.num_overloaded = 0
        self.max_pending = 0
        self.num_refused_overloaded = 0
        self.silent = False
        self.silent_health = False
        self.hang_after_accept = False
        self.reverse = False
        self.gate_min_policy_version = False
        self.update_version = 0
        self.paused = False
        self.delay_with_probes_s = 0.0
        self.num_probes_sent = 0
        self.fail_verify = False
        self.verify_delay_s = 0.0
        self.busy_begins = 0  # answer this many update_begin messages with error busy
        self.rope_layout = "interleaved"  # health's model.rope_layout; None: not reported
        # "update_chunk", "update_commit" or "update_apply": at the first such message of an open
        # update, act as a worker that shuts down: send the notice (error shutting_down, field
        # update_id, the begin's id), drop the update, and answer no update message after it.
        self.shutdown_notice_after = ""
        self.shut_down = False
        self.bad_checksum = False
        self.version = 0
        self.weights = {k: np.zeros(v, dtype=np.float32) for k, v in self.params.items()}
        self.received: List[Tuple[str, Dict[str, Any]]] = []
        self._update: Optional[Dict[str, Any]] = None
        self._held: List[List[bytes]] = []
        self._running: List[Tuple[bytes, List[Dict[str, Any]]]] = []  # (peer, sample replies)
        self._delayed: List[Tuple[float, bytes, List[Dict[str, Any]]]] = []  # (release at, peer, samples)
        self._next_probe = 0.0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake worker did not start")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def types(self) -> List[str]:
        return [t for t, _ in self.received]

    # Worker thread only from here on.

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve_secret_key is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve_secret_key)
        if self._bind:
            sock.bind(self._bind)
            self.endpoint = self._bind
        else:
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self._ready.set()
        try:
            while not self._stop.is_set():
                if self._delayed:
                    now = time.monotonic()
                    if now >= self._next_probe:
                        for peer in {d[1] for d in self._delayed}:
                            probe = self._handle({"type": "health", "id": ""}, [])[0]
                            sock.send_multipart([peer, msgpack.packb(probe, use_bin_type=True)])
                            self.num_probes_sent += 1
                        self._next_probe = now + 0.1
                    for d in [d for d in self._delayed if d[0] <= now]:
                        self._delayed.remove(d)
                        for reply in d[2]:
                            sock.send_multipart([d[1], msgpack.packb(reply, use_bin_type=True)])
                if not sock.poll(1 if self._running else 10 if self._delayed else 20):
                    if self._running:
                        peer, samples = self._running.pop(0)
                        for reply in samples:
                            sock.send_multipart([peer, msgpack.packb(reply, use_bin_type=True)])
                    for frames in reversed(self._held):
                        sock.send_multipart(frames)
                    self._held.clear()
                    continue
                frames = sock.recv_multipart()
                peer, header, payload = frames[0], msgpack.unpackb(frames[1], raw=False), frames[2:]
                self.received.append((header["type"], header))
                replies = self._handle(header, payload)
                if self.max_pending > 0 and replies and replies[0]["type"] == "accepted":
                    self._running.append((peer, replies[1:]))
                    replies = replies[:1]
                elif self.delay_with_probes_s > 0 and replies and replies[0]["type"] == "accepted":
                    self._delayed.append((time.monotonic() + self.delay_with_probes_s, peer, replies[1:]))
                    replies = replies[:1]
                for reply in replies:
                    out = [peer, msgpack.packb(reply, use_bin_type=True)]
                    if self.reverse and reply["type"] == "sample":
                        self._held.append(out)
                    else:
                        sock.send_multipart(out)
        finally:
            sock.close(0)

    def _error(self, header: Dict[str, Any], code: str, message: str, field: str = "") -> Dict:
        return {"v": 1, "type": "error", "id": header.get("id", ""), "code": code,
                "field": field, "message": message}

    def _ack(self, header: Dict[str, Any], stage: str, **extra: Any) -> Dict:
        return {"v": 1, "type": "update_ack", "id": header["id"],
                "update_id": header["update_id"], "stage": stage, "version": self.version,
                **extra}

    def _handle(self, h: Dict[str, Any], payload: List[bytes]) -> List[Dict[str, Any]]:
        type_ = h["type"]
        if type_ == "generate":
            return self._generate(h)
        if type_ == "abort":
            return [{"v": 1, "type": "abort_ack", "id": h.get("id", ""),
                     "request_id": h["request_id"]}]
        if type_ == "health" and self.silent_health and h.get("id"):
            return []
        if type_ == "health":
            return [{"v": 1, "type": "health", "id": h["id"], "ok": True,
                     "policy_version": self.version, "update_version": self.update_version,
                     "paused": self.paused,
                     "protocol_version": 1,
                     "model": {"vocab_size": self.vocab_size, "max_seq_len": 32, "dim": 8,
                               "n_layers": 1,
                               **({"rope_layout": self.rope_layout} if self.rope_layout else {})}}]
        if type_ == "stats":
            return [{"v": 1, "type": "stats", "id": h["id"], "num_running": 0,
                     "policy_version": self.version}]
        if type_ in ("pause", "resume", "flush_cache", "shutdown"):
            return [{"v": 1, "type": type_ + "_ack", "id": h["id"]}]
        if type_.startswith("update_"):
            return self._weights(h, payload)
        return [self._error(h, "unknown_type", f"type {type_!r}")]

    def _generate(self, h: Dict[str, Any]) -> List[Dict[str, Any]]:
        if self.silent:
            return []
        if self.num_overloaded > 0:
            self.num_overloaded -= 1
            self.num_refused_overloaded += 1
            return [self._error(h, "overloaded", "max_pending_requests = 0 reached")]
        if 0 < self.max_pending <= len(self._running):
            self.num_refused_overloaded += 1
            return [self._error(h, "overloaded",
                                f"max_pending_requests = {self.max_pending} reached")]
        prompt = h["prompt"]
        for i, t in enumerate(prompt):
            if not 0 <= t < self.vocab_size:
                return [self._error(h, "bad_field", f"prompt[{i}] = {t} outside the "
                                    f"vocabulary [0, {self.vocab_size})", f"prompt[{i}]")]
        n = h.get("n", 1)
        max_new = h.get("sampling", {}).get("max_new_tokens", 16)
        replies = [{"v": 1, "type": "accepted", "id": h["id"], "request_id": h["request_id"],
                    "policy_version": self.version}]
        if self.hang_after_accept or (self.gate_min_policy_version and
                                      h.get("min_policy_version", 0) > self.version):
            return replies
        for i in range(n):
            ids = expected_tokens(prompt, i, max_new, self.vocab_size)
            replies.append({
                "v": 1, "type": "sample", "id": h["id"], "request_id": h["request_id"],
                "sample_index": i, "output_ids": ids, "logprobs": [-0.5] * len(ids),
                "finish_reason": "length", "policy_version": self.version,
                "version_spans": [[0, len(ids), self.version]],
                "num_prompt_tokens": len(prompt), "num_cached_prompt_tokens": 0,
                "num_preemptions": 0, "queue_ms": 0.1, "first_token_ms": 0.2, "total_ms": 0.3})
        return replies

    def _weights(self, h: Dict[str, Any], payload: List[bytes]) -> List[Dict[str, Any]]:
        type_, u = h["type"], self._update
        if self.shut_down:  # as a worker between its shutdown and its exit: chunks are refused
            if type_ == "update_chunk":
                return [self._error(h, "unknown_update", f"no open update {h.get('update_id')!r}",
                                    "update_id")]
            return []
        if u is not None and type_ == self.shutdown_notice_after and h.get("update_id") == u["id"]:
            self.shut_down = True
            self._update = None
            return [{"v": 1, "type": "error", "id": u["begin_id"], "code": "shutting_down",
                     "field": "update_id",
                     "message": f"update {u['id']!r} aborted: the worker is shutting down"}]
        if type_ == "update_begin":
            if self.busy_begins > 0:
                self.busy_begins -= 1
                return [self._error(h, "busy", "another update is open")]
            if h["version"] <= self.version:
                return [self._error(h, "update_failed", "version not newer", "version")]
            for i, t in enumerate(h["tensors"]):
                if self.params.get(t["name"]) != list(t["shape"]):
                    self._update = None
                    return [self._error(h, "update_failed",
                                        f"{t['name']}: shape {t['shape']} != "
                                        f"{self.params.get(t['name'])}", f"tensors[{i}].shape")]
            self._update = {"id": h["update_id"], "begin_id": h["id"], "version": h["version"],
                            "tensors": {t["name"]: t for t in h["tensors"]},
                            "bytes": {t["name"]: bytearray(t["num_bytes"]) for t in h["tensors"]},
                            "written": {t["name"]: 0 for t in h["tensors"]}, "verified": False}
            if self.shutdown_notice_after == "update_begin":  # begun, then at once the notice
                return [self._ack(h, "begun")] + self._weights(h, payload)
            return [self._ack(h, "begun")]
        if u is None or h.get("update_id") != u["id"]:
            return [self._error(h, "unknown_update", f"no open update {h.get('update_id')!r}")]
        if type_ == "update_chunk":
            (data,) = payload
            buf = u["bytes"][h["name"]]
            assert h["offset"] + len(data) <= len(buf), "chunk out of range"
            buf[h["offset"]:h["offset"] + len(data)] = data
            u["written"][h["name"]] += len(data)
            return []
        if type_ == "update_abort":
            self._update = None
            return [self._ack(h, "aborted")]
        if type_ == "update_commit":
            for name, t in u["tensors"].items():
                if u["written"][name] != t["num_bytes"]:
                    return [self._error(h, "update_failed", f"{name}: incomplete")]
                if xxhash.xxh3_64_intdigest(bytes(u["bytes"][name])) != t["checksum"]:
                    return [self._error(h, "update_failed", f"{name}: checksum mismatch")]
            if self.fail_verify:
                return [self._error(h, "update_failed", "model.norm.weight: checksum mismatch")]
            if not u["verified"]:
                time.sleep(self.verify_delay_s)
            u["verified"] = True
            if h.get("apply", True):
                return self._apply(h)
            return [self._ack(h, "verified")]
        if type_ == "update_apply":
            if not u["verified"]:
                return [self._error(h, "update_failed", "not verified")]
            return self._apply(h)
        return [self._error(h, "unknown_type", type_)]

    def _apply(self, h: Dict[str, Any]) -> List[Dict[str, Any]]:
        u = self._update
        for name, t in u["tensors"].items():
            self.weights[name] = _to_float32(t["dtype"], bytes(u["bytes"][name]), t["shape"])
        self.version = u["version"]
        self._update = None
        checksum = reference_weights_checksum(self.weights) ^ (1 if self.bad_checksum else 0)
        return [self._ack(h, "applied", weights_checksum=checksum, num_drained=0, wait_ms=0.0,
                          stall_ms=0.1)]
