"""End to end: vroll_client against real vroll-worker processes started here (the embedded
default model, ipc:// endpoints with unique paths). Skipped unless VROLL_WORKER names the
vroll-worker binary (ctest sets it)."""
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import torch
import zmq

from vroll_client import (SamplingParams, VrollClient, VrollTimeoutError, WeightUpdateError,
                          WorkerError, curve_keypair, weights_checksum)

WORKER = os.environ.get("VROLL_WORKER", "")
SKIP_REASON = "VROLL_WORKER is not set (ctest sets it to the vroll-worker binary)"
STARTUP_TIMEOUT_S = 120

# The embedded default model (policy/default_model.cc): tied head, byte-level vocabulary.
VOCAB, DIM, HIDDEN, N_LAYERS, N_HEADS, N_KV_HEADS = 259, 64, 172, 4, 8, 4


def default_model_shapes():
    head_dim = DIM // N_HEADS
    shapes = {"model.embed_tokens.weight": [VOCAB, DIM], "model.norm.weight": [DIM]}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [DIM],
            p + "self_attn.q_proj.weight": [N_HEADS * head_dim, DIM],
            p + "self_attn.k_proj.weight": [N_KV_HEADS * head_dim, DIM],
            p + "self_attn.v_proj.weight": [N_KV_HEADS * head_dim, DIM],
            p + "self_attn.o_proj.weight": [DIM, N_HEADS * head_dim],
            p + "post_attention_layernorm.weight": [DIM],
            p + "mlp.gate_proj.weight": [HIDDEN, DIM],
            p + "mlp.up_proj.weight": [HIDDEN, DIM],
            p + "mlp.down_proj.weight": [DIM, HIDDEN]})
    return shapes


def make_weights(seed):
    """Full weights for the default model in mixed dtypes: bf16 embeddings, fp16 attention
    projections, fp32 norms and MLP (as a trainer in mixed precision might hold them)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in default_model_shapes().items():
        if len(shape) == 1:
            weights[name] = 1.0 + 0.01 * torch.randn(shape, generator=g)
        else:
            weights[name] = 0.05 * torch.randn(shape, generator=g)
        if "embed_tokens" in name:
            weights[name] = weights[name].bfloat16()
        elif "self_attn" in name:
            weights[name] = weights[name].half()
    return weights


class WorkerProcess:
    """One vroll-worker on `endpoint`; its stderr goes to a log file in `log_dir`."""

    def __init__(self, endpoint, log_dir, name, extra_args=(), env=None):
        self.endpoint = endpoint
        self.log_path = os.path.join(log_dir, name + ".log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [WORKER, "--endpoint", endpoint, "--threads", "1", "--kv-cache-mb", "16",
             *extra_args], stdout=subprocess.PIPE, stderr=self._log,
            env=None if env is None else {**os.environ, **env})
        ready, _, _ = select.select([self.proc.stdout], [], [], STARTUP_TIMEOUT_S)
        line = self.proc.stdout.readline().decode().strip() if ready else ""
        if line != endpoint:
            self.kill()
            raise RuntimeError(f"vroll-worker did not report {endpoint} (got {line!r}); "
                               f"log:\n{self.log()}")

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def kill(self):
        """SIGKILL, as a crash would: nothing is flushed or answered."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._close()

    def _close(self):
        self.proc.stdout.close()
        self._log.close()


@unittest.skipUnless(WORKER, SKIP_REASON)
class TwoWorkersTest(unittest.TestCase):
    """Two workers and one client, shared by the tests of this class (each test reads the
    versions it starts from instead of assuming them)."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="vroll-e2e-")
        cls.endpoints = [f"ipc://{cls.tmp.name}/w{i}.sock" for i in range(2)]
        cls.workers = []
        for i, ep in enumerate(cls.endpoints):
            cls.workers.append(WorkerProcess(ep, cls.tmp.name, f"w{i}"))
        cls.client = VrollClient(cls.endpoints, timeout_s=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close(linger_ms=0)
        for w in cls.workers:
            w.stop()
        cls.tmp.cleanup()

    def versions(self):
        return [h["policy_version"] for h in self.client.health().values()]

    def test_health_describes_the_default_model(self):
        for h in self.client.health().values():
            self.assertTrue(h["ok"])
            self.assertEqual(h["protocol_version"], 1)
            self.assertEqual(h["model"], {"vocab_size": VOCAB, "max_seq_len": 256, "dim": DIM,
                                          "n_layers": N_LAYERS, "max_model_len": 256,
                                          "rope_layout": "interleaved"})

    def test_generate_n_samples_counts_token_ranges_and_logprobs(self):
        prompts = [[1, 72, 101, 108], [1, 84], [1, 87, 111, 114, 108, 100, 33]]
        outs = self.client.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12,
                                                            seed=5), n=4)
        self.assertEqual(len(outs), 3)
        self.assertEqual({o.worker for o in outs}, set(self.endpoints))  # both workers used
        version = max(self.versions())
        for prompt, out in zip(prompts, outs):
            self.assertEqual(out.prompt_token_ids, prompt)
            self.assertEqual([c.index for c in out.outputs], [0, 1, 2, 3])
            for c in out.outputs:
                self.assertEqual(c.finish_reason, "length")
                self.assertEqual(len(c.token_ids), 12)
                self.assertTrue(all(0 <= t < VOCAB for t in c.token_ids), c.token_ids)
                self.assertEqual(len(c.logprobs), 12)
                self.assertTrue(all(-1e4 < lp <= 0.0 for lp in c.logprobs), c.logprobs)
                self.assertEqual(c.version_spans, [(0, 12, c.policy_version)])
                self.assertLessEqual(c.policy_version, version)
                self.assertEqual(c.num_prompt_tokens, len(prompt))
        self.assertEqual(len({tuple(c.token_ids) for c in outs[0].outputs}), 4)

    def test_a_paused_worker_says_so_and_a_generate_on_it_times_out_naming_the_pause(self):
        ep = self.endpoints[0]
        self.assertFalse(self.client.health([ep])[ep]["paused"])
        client = VrollClient(ep, timeout_s=1.0, linger_ms=0)
        try:
            self.client.pause([ep])
            self.assertTrue(self.client.health([ep])[ep]["paused"])
            self.assertTrue(self.client.stats([ep])[ep]["paused"])
            with self.assertRaises(VrollTimeoutError) as cm:
                client.generate([1, 2], SamplingParams(max_tokens=2))
            self.assertIn("health() says paused", str(cm.exception))
        finally:
            self.client.resume([ep])
            client.close(linger_ms=0)
        self.assertFalse(self.client.health([ep])[ep]["paused"])

    def test_vllm_none_values_mean_no_top_k_and_until_the_context_is_full(self):
        outs = self.client.generate([[1, 72, 101]], SamplingParams(max_tokens=None, top_k=None,
                                                                   seed=3))
        c = outs[0].outputs[0]
        self.assertEqual((c.finish_reason, len(c.token_ids)), ("length", 256 - 3))

    def test_unseeded_requests_draw_different_samples_on_different_workers(self):
        # The class's workers run without --seed: each draws its own seed stream at random, so
        # the same unseeded request sent to both must not repeat a sample (with one shared default
        # seed stream, every worker returned the same samples and a restarted one replayed them).
        prompt = [1, 72, 101, 108]
        params = SamplingParams(temperature=1.0, max_tokens=16)
        samples = {}
        for ep in self.endpoints:
            out = self.client.generate([prompt], params, n=4, endpoints=[ep])[0]
            samples[ep] = {tuple(c.token_ids) for c in out.outputs}
        a, b = (samples[ep] for ep in self.endpoints)
        self.assertEqual(len(a), 4)
        self.assertEqual(len(b), 4)
        self.assertEqual(a & b, set(), "two workers drew the same unseeded samples")

    def test_workers_given_the_same_seed_draw_the_same_unseeded_samples(self):
        # --seed makes unseeded requests reproducible: two fresh workers started with the same
        # seed, weights and requests in the same order return the same samples.
        prompt = [1, 84, 104]
        params = SamplingParams(temperature=1.0, max_tokens=16)
        seeded = [WorkerProcess(f"ipc://{self.tmp.name}/seeded{i}.sock", self.tmp.name, f"seeded{i}",
                                ["--seed", "1234"]) for i in range(2)]
        client = VrollClient([w.endpoint for w in seeded], timeout_s=60)
        try:
            runs = [[tuple(c.token_ids) for c in client.generate([prompt], params, n=3,
                                                                   endpoints=[w.endpoint])[0].outputs]
                    for w in seeded]
        finally:
            client.close(linger_ms=0)
            for w in seeded:
                w.stop()
        self.assertEqual(runs[0], runs[1])
        self.assertEqual(len(set(runs[0])), 3)

    def test_sampling_fields_reach_the_worker(self):
        # The worker ignores unknown fields, so a misnamed one would pass silently: check that
        # each field changes what comes back.
        prompt = [1, 72, 101, 108, 108, 111]
        greedy = self.client.generate([prompt], SamplingParams(temperature=0, max_tokens=10),
                                      n=3)[0].outputs
        self.assertEqual(len({tuple(c.token_ids) for c in greedy}), 1)  # temperature 0
        tokens = greedy[0].token_ids
        top_k1 = self.client.generate([prompt], SamplingParams(top_k=1, max_tokens=10, seed=1))
        self.assertEqual(top_k1[0].outputs[0].token_ids, tokens)  # top_k
        top_p = self.client.generate([prompt], SamplingParams(top_p=1e-6, max_tokens=10, seed=2))
        self.assertEqual(top_p[0].outputs[0].token_ids, tokens)  # top_p
        seeded = [self.client.generate([prompt], SamplingParams(max_tokens=10, seed=99), n=2)
                  for _ in range(2)]
        self.assertEqual([c.token_ids for c in seeded[0][0].outputs],
                         [c.token_ids for c in seeded[1][0].outputs])  # seed
        stop = tokens[3]
        first = tokens.index(stop)
        for include in (True, False):
            with self.subTest(include_stop_token=include):
                out = self.client.generate([prompt], SamplingParams(
                    temperature=0, max_tokens=10, stop_token_ids=[stop],
                    include_stop_token=include))[0].outputs[0]
                self.assertEqual(out.finish_reason, "stop")
                self.assertEqual(out.token_ids, tokens[:first + 1] if include else tokens[:first])

    def test_bad_prompt_raises_worker_error_naming_the_field(self):
        with self.assertRaises(WorkerError) as cm:
            self.client.generate([[1, 2], [1, 5, VOCAB + 10]])
        self.assertEqual((cm.exception.code, cm.exception.field), ("bad_field", "prompt[2]"))
        self.assertIn(cm.exception.worker, self.endpoints)
        with self.assertRaises(WorkerError) as cm:  # the worker's check (the vocabulary)
            self.client.generate([[1]], SamplingParams(stop_token_ids=[2, VOCAB]))
        self.assertEqual(cm.exception.field, "sampling.stop_token_ids[1]")
        self.assertEqual(len(self.client.generate([[1, 2]])[0].outputs), 1)  # still serving

    def test_two_phase_push_to_both_then_samples_carry_the_new_version(self):
        version = max(self.versions()) + 1
        weights = make_weights(seed=version)
        acks = self.client.push_weights(weights, version=version, chunk_bytes=4096 + 3, rope_layout=None)
        expected = weights_checksum(weights)
        self.assertEqual([a.worker for a in acks], self.endpoints)
        for ack in acks:
            self.assertEqual((ack.stage, ack.version, ack.weights_checksum),
                             ("applied", version, expected))
            self.assertGreaterEqual(ack.stall_ms, 0.0)
        self.assertEqual(self.versions(), [version, version])
        outs = self.client.generate([[1, 65]] * 4, SamplingParams(max_tokens=6, seed=3), n=2,
                                    min_policy_version=version)
        for c in (c for o in outs for c in o.outputs):
            self.assertEqual(c.policy_version, version)
            self.assertEqual(c.version_spans, [(0, 6, version)])
        # Same weights, same seed: both workers now compute the same samples.
        by_worker = {o.worker: [c.token_ids for c in o.outputs] for o in outs}
        self.assertEqual(len(by_worker), 2)
        self.assertEqual(*by_worker.values())

    def test_an_apply_timeout_says_the_worker_still_applies_the_update(self):
        # helper-64: a drain update whose apply_timeout_s ran out was reported as "0 worker(s)
        # applied it", and the worker applied it a second later. The update is in the engine and
        # cannot be withdrawn: the error says so, from the worker's health, and it does apply.
        ep = self.endpoints[0]
        version = max(self.versions()) + 1
        generator = VrollClient(ep, timeout_s=60, linger_ms=0)
        done = threading.Event()
        outs = []

        def generate():
            try:
                outs.extend(generator.generate([[1, 72, 105]], SamplingParams(temperature=1.0, max_tokens=240, seed=1),
                                               n=8))
            finally:
                done.set()

        thread = threading.Thread(target=generate)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while self.client.stats([ep])[ep]["num_running"] == 0:  # drain has something to wait for
                self.assertLess(time.monotonic(), deadline, "the generate never ran")
                time.sleep(0.005)
            with self.assertRaises(WeightUpdateError) as cm:
                self.client.push_weights(make_weights(seed=version), version=version, endpoints=[ep],
                                         mode="drain", apply_timeout_s=0.01, rope_layout=None)
            err = cm.exception
            self.assertEqual((err.phase, err.applied, list(err.failures)), ("apply", [], [ep]))
            self.assertIsInstance(err.failures[ep], VrollTimeoutError)
            self.assertIn(ep, err.pending)
            state = err.pending[ep]
            self.assertTrue(state.startswith("applied it since") or "applies version" in state, state)
            self.assertIn(state, str(err))
        finally:
            thread.join(60)
            generator.close(linger_ms=0)
        self.assertTrue(done.is_set())
        deadline = time.monotonic() + 30
        while self.client.health([ep])[ep]["policy_version"] != version:
            self.assertLess(time.monotonic(), deadline, "the update was never applied")
            time.sleep(0.01)
        self.assertEqual([c.policy_version for c in outs[0].outputs], [version - 1] * 8)  # drained under the old

    def test_wrong_shape_fails_on_both_and_versions_stay(self):
        before = self.versions()
        weights = make_weights(seed=7)
        weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(HIDDEN + 1, DIM)
        with self.assertRaises(WeightUpdateError) as cm:
            self.client.push_weights(weights, version=max(before) + 1, rope_layout=None)
        err = cm.exception
        self.assertIn(err.phase, ("begin", "verify"))
        self.assertEqual(set(err.failures), set(self.endpoints))
        for failure in err.failures.values():
            self.assertIsInstance(failure, WorkerError)
            self.assertIn("model.layers.1.mlp.up_proj.weight", str(failure))
        self.assertEqual(err.applied, [])
        self.assertEqual(self.versions(), before)
        outs = self.client.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4), n=2)
        self.assertEqual([len(o.outputs) for o in outs], [2, 2])
        # The failed update left nothing open: the next push goes through.
        self.client.push_weights(make_weights(seed=8), version=max(before) + 1, rope_layout=None)
        self.assertEqual(self.versions(), [max(before) + 1] * 2)

    def test_a_tied_models_state_dict_with_lm_head_pushes_and_a_differing_head_is_refused(self):
        # A Hugging Face model with tied embeddings lists lm_head.weight in its state_dict()
        # as the very tensor of model.embed_tokens.weight; the default model is tied too.
        before = self.versions()
        weights = make_weights(seed=21)
        state_dict = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
        # Older transformers versions also put each layer's RoPE buffer in state_dict(): left out
        # by the client, as the worker's loader and vLLM skip them (helper-70: refused as unknown).
        layers = {name.split(".")[2] for name in weights if name.startswith("model.layers.")}
        for layer in layers:
            state_dict[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        version = max(before) + 1
        acks = self.client.push_weights(state_dict, version=version, chunk_bytes=5000, rope_layout=None)
        for ack in acks:  # the worker holds one matrix: the checksum of the weights without the copy
            self.assertEqual((ack.stage, ack.version, ack.weights_checksum),
                             ("applied", version, weights_checksum(weights)))
        self.assertEqual(self.versions(), [version, version])
        with self.assertRaisesRegex(ValueError, "only RoPE buffers"):
            self.client.push_weights({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)},
                                     version=version + 1, partial=True, rope_layout=None)
        # A head that is not the embedding (an untied trainer model) cannot be held: refused on
        # both, naming the field, and nothing changes.
        other = make_weights(seed=22)
        other["lm_head.weight"] = other["model.embed_tokens.weight"] * 2
        with self.assertRaises(WeightUpdateError) as cm:
            self.client.push_weights(other, version=version + 1, rope_layout=None)
        self.assertEqual(cm.exception.phase, "begin")
        self.assertEqual(set(cm.exception.failures), set(self.endpoints))
        for failure in cm.exception.failures.values():
            self.assertIsInstance(failure, WorkerError)
            self.assertEqual((failure.code, failure.field), ("bad_field", "tensors[0].checksum"))
            self.assertIn("differs from its embedding", str(failure))
        self.assertEqual(self.versions(), [version, version])

    def test_a_partial_update_is_refused_where_the_workers_run_other_versions(self):
        # helper-77: a worker restarted at version 0 took a partial update made for the others'
        # version and reported the same version with other weights.
        before = self.versions()
        ahead = max(before) + 1
        self.client.push_weights(make_weights(seed=41), version=ahead, endpoints=[self.endpoints[0]],
                                 rope_layout=None)
        norm = {"model.norm.weight": torch.full((DIM,), 1.5)}
        with self.assertRaises(WeightUpdateError) as cm:
            self.client.push_weights(norm, version=ahead + 1, partial=True, rope_layout=None)
        self.assertEqual(cm.exception.phase, "version")
        self.assertEqual(list(cm.exception.failures), [self.endpoints[1]])
        self.assertEqual(self.versions(), [ahead, before[1]])
        # The worker checks a declared base version itself (another trainer may push meanwhile).
        with self.assertRaises(WeightUpdateError) as cm:
            self.client.push_weights(norm, version=ahead + 1, partial=True, base_version=ahead,
                                     rope_layout=None)
        self.assertEqual(cm.exception.phase, "begin")
        self.assertEqual(list(cm.exception.failures), [self.endpoints[1]])
        failure = cm.exception.failures[self.endpoints[1]]
        self.assertEqual((failure.code, failure.field), ("bad_field", "base_version"))
        self.assertIn(f"runs version {before[1]}", str(failure))
        self.assertEqual(self.versions(), [ahead, before[1]])
        # Brought to one version, the partial update applies on both, with the same weights.
        self.client.ensure_weights(make_weights(seed=41), ahead, rope_layout=None)
        acks = self.client.push_weights(norm, version=ahead + 1, partial=True, rope_layout=None)
        self.assertEqual(len({a.weights_checksum for a in acks}), 1)
        self.assertEqual(self.versions(), [ahead + 1] * 2)

    def test_rope_layout_is_checked_against_the_workers_before_anything_is_sent(self):
        # The default model is llama2.c-style (interleaved RoPE): weights declared in Hugging
        # Face order are refused before anything is sent; declared interleaved, they go through.
        before = self.versions()
        weights = make_weights(seed=31)
        with self.assertRaises(ValueError) as cm:
            self.client.push_weights(weights, version=max(before) + 1, rope_layout="half_split")
        self.assertIn("uses interleaved RoPE", str(cm.exception))
        self.assertIn("nothing sent", str(cm.exception))
        self.assertEqual(self.versions(), before)
        with self.assertRaises(ValueError):
            self.client.push_weights(weights, version=max(before) + 1, rope_layout="rotate_half")
        # The workers check it again in update_begin (bad_field rope_layout, no update opened):
        # seen here with the client's own health check switched off.
        unchecked = VrollClient(self.endpoints, timeout_s=60)
        try:
            unchecked._check_rope_layout = lambda workers, layout: None
            with self.assertRaises(WeightUpdateError) as cm:
                unchecked.push_weights(weights, version=max(before) + 1, rope_layout="half_split")
            self.assertIn("rope_layout", str(cm.exception))
            self.assertIn("the model computes RoPE interleaved", str(cm.exception))
        finally:
            unchecked.close()
        self.assertEqual(self.versions(), before)
        acks = self.client.push_weights(weights, version=max(before) + 1, rope_layout="interleaved")
        self.assertEqual([a.version for a in acks], [max(before) + 1] * 2)

    def test_an_undeclared_rope_layout_means_hugging_face_order_which_the_worker_checks(self):
        # helper-67: the README's push_weights(named_tensors, version), given Hugging Face-order
        # weights, was applied to a worker running a llama2.c checkpoint (interleaved RoPE) and
        # it generated garbage. Undeclared now means half_split, checked in update_begin: refused
        # on both workers (phase begin, aborted everywhere), naming the layouts and the way out.
        before = self.versions()
        weights = make_weights(seed=32)
        with self.assertRaises(WeightUpdateError) as cm:
            self.client.push_weights(weights, version=max(before) + 1)
        err = cm.exception
        self.assertEqual((err.phase, sorted(err.failures)), ("begin", sorted(self.endpoints)))
        for failure in err.failures.values():
            self.assertEqual((failure.code, failure.field), ("bad_field", "rope_layout"))
        self.assertIn("the model computes RoPE interleaved", str(err))
        self.assertIn("pass rope_layout='interleaved' for llama2.c-ordered weights", str(err))
        self.assertEqual(self.versions(), before)
        for h in self.client.health().values():
            self.assertEqual(h["update_version"], 0)
        with self.assertRaises(WeightUpdateError):  # ensure_weights has the same default
            self.client.ensure_weights(weights, version=max(before) + 1)
        self.assertEqual(self.versions(), before)

    def test_bad_checksum_in_one_workers_stream_is_aborted_everywhere(self):
        before = self.versions()
        weights = make_weights(seed=9)
        client = VrollClient(self.endpoints, timeout_s=60)
        try:
            # Corrupt what one worker receives: flip a byte in the first chunk sent to worker 1.
            original = client._send
            state = {"done": False}

            def corrupting_send(worker, header, frames=(), request="", **kwargs):
                if (header["type"] == "update_chunk" and worker.endpoint == self.endpoints[1]
                        and not state["done"]):
                    state["done"] = True
                    state["tensor"] = header["name"]
                    data = bytearray(frames[0])
                    data[0] ^= 0xFF
                    frames = [bytes(data)]
                return original(worker, header, frames, request, **kwargs)

            client._send = corrupting_send
            with self.assertRaises(WeightUpdateError) as cm:
                client.push_weights(weights, version=max(before) + 1, rope_layout=None)
        finally:
            client.close(linger_ms=0)
        self.assertEqual(cm.exception.phase, "verify")
        self.assertEqual(list(cm.exception.failures), [self.endpoints[1]])
        self.assertEqual(cm.exception.failures[self.endpoints[1]].code, "update_failed")
        self.assertEqual(cm.exception.failures[self.endpoints[1]].tensor, state["tensor"])
        self.assertEqual(self.versions(), before)

    def test_chunk_refused_mid_stream_is_aborted_everywhere(self):
        before = self.versions()
        client = VrollClient(self.endpoints, timeout_s=60)
        try:
            # Send worker 0 one chunk twice: the overlap poisons its update at that chunk.
            original = client._send
            state = {"first": None}

            def duplicating_send(worker, header, frames=(), request="", **kwargs):
                if header["type"] == "update_chunk" and worker.endpoint == self.endpoints[0]:
                    if state["first"] is None:
                        state["first"] = (dict(header), list(frames))
                    elif header["offset"] > 0 and state["first"] != "sent":
                        first_header, first_frames = state["first"]
                        state["first"] = "sent"
                        state["tensor"] = first_header["name"]
                        original(worker, dict(first_header, id=header["id"] + "x"), first_frames)
                return original(worker, header, frames, request, **kwargs)

            client._send = duplicating_send
            with self.assertRaises(WeightUpdateError) as cm:
                client.push_weights(make_weights(seed=10), version=max(before) + 1,
                                    chunk_bytes=1024, rope_layout=None)
        finally:
            client.close(linger_ms=0)
        self.assertEqual(cm.exception.phase, "stage")
        self.assertEqual(list(cm.exception.failures), [self.endpoints[0]])
        failure = cm.exception.failures[self.endpoints[0]]
        self.assertEqual((failure.code, failure.request), ("update_failed", "update_chunk"))
        self.assertEqual(failure.tensor, state["tensor"])
        self.assertEqual(self.versions(), before)
        self.client.push_weights(make_weights(seed=10), version=max(before) + 1, rope_layout=None)

    def test_a_push_interrupted_inside_a_chunk_is_aborted_and_the_client_stays_usable(self):
        # Ctrl-C lands after worker 0's chunk header was queued and before its bytes: the half
        # message used to stay on the socket (the next request became its bytes: health timed
        # out), and the update stayed open on both workers (a push from this client then failed
        # busy until their update_timeout_ms).
        before = self.versions()
        client = VrollClient(self.endpoints, timeout_s=10)
        try:
            sock = client._workers[0].socket
            real_send = sock.send
            calls = {"chunks": 0}

            def interrupted_send(data, flags=0, copy=True, track=False):
                if flags & zmq.SNDMORE == 0 and calls.get("header_pending"):
                    calls["chunks"] += 1
                    if calls["chunks"] == 3:
                        raise KeyboardInterrupt
                calls["header_pending"] = bool(flags & zmq.SNDMORE)
                return real_send(data, flags, copy=copy, track=track)

            sock.send = interrupted_send
            with self.assertRaises(KeyboardInterrupt):
                client.push_weights(make_weights(seed=11), version=max(before) + 1,
                                    chunk_bytes=1024, rope_layout=None)
            self.assertEqual(calls["chunks"], 3)
            health = client.health(timeout_s=5)
            self.assertEqual([h["policy_version"] for h in health.values()], before)
            self.assertEqual(health[self.endpoints[1]]["update_version"], 0)  # aborted
            # Worker 0 drops the update of the closed socket at the next begin at the latest.
            acks = client.push_weights(make_weights(seed=11), version=max(before) + 1,
                                       rope_layout=None, busy_wait_s=0)
            self.assertEqual([a.version for a in acks], [max(before) + 1] * 2)
        finally:
            client.close(linger_ms=0)

    def test_a_call_from_a_second_thread_is_refused_while_the_first_is_inside(self):
        client = VrollClient(self.endpoints, timeout_s=60)
        errors = []

        def call_health():
            try:
                client.health()
                errors.append(None)
            except RuntimeError as exc:
                errors.append(exc)

        try:
            it = client.generate_iter([[1, 2, 3], [1, 4]], SamplingParams(max_tokens=4), n=2)
            next(it)  # the iteration is open: this thread is inside the client
            other = threading.Thread(target=call_health, name="second")
            other.start()
            other.join()
            self.assertIsInstance(errors[0], RuntimeError)
            self.assertRegex(str(errors[0]), r"thread 'second'.*thread 'MainThread'.*generate_iter")
            self.assertEqual(len(list(it)), 1)  # the first thread's iteration is unharmed
            # Between calls, a client may move to another thread.
            other = threading.Thread(target=call_health, name="third")
            other.start()
            other.join()
            self.assertIsNone(errors[1])
        finally:
            client.close(linger_ms=0)

    def test_generate_iter_yields_groups_as_they_complete_and_an_early_exit_aborts_the_rest(self):
        short, long_ = SamplingParams(temperature=1.0, max_tokens=4), SamplingParams(
            temperature=1.0, max_tokens=240)
        prompts = [[1, 72], [1, 84], [1, 87], [1, 66], [1, 99], [1, 70]]
        params = [long_, short, long_, short, long_, short]
        got = []
        for out in self.client.generate_iter(prompts, params, n=4):
            self.assertEqual(out.prompt_token_ids, prompts[out.prompt_index])
            self.assertEqual([c.index for c in out.outputs], [0, 1, 2, 3])
            got.append(out)
            if len(got) == 3:
                break
        # The three 4-token groups finish ~236 steps before any 240-token one.
        self.assertEqual(sorted(o.prompt_index for o in got), [1, 3, 5])
        self.assertTrue(all(len(c.token_ids) == 4 for o in got for c in o.outputs))

        def idle():
            return all(s["num_running"] == 0 and s["num_waiting"] == 0
                       for s in self.client.stats().values())
        deadline = time.monotonic() + 30
        while not idle():
            self.assertLess(time.monotonic(), deadline, "workers still busy after the early exit")
            time.sleep(0.05)
        # The aborted groups' samples are dropped, not mistaken for the next call's.
        outs = self.client.generate([[1, 72], [1, 84]], short, n=2)
        self.assertEqual([o.prompt_index for o in outs], [0, 1])
        self.assertTrue(all(len(c.token_ids) == 4 and c.finish_reason == "length"
                            for o in outs for c in o.outputs))

    def test_cli_health_and_stats(self):
        env = dict(os.environ)
        for command in ("health", "stats"):
            with self.subTest(command=command):
                result = subprocess.run(
                    [sys.executable, "-m", "vroll_client", "--endpoint", self.endpoints[0],
                     command], capture_output=True, text=True, timeout=120, env=env)
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertIn('"policy_version"', result.stdout)


@unittest.skipUnless(WORKER, SKIP_REASON)
class WorkerRestartTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="vroll-e2e-")
        self.endpoints = [f"ipc://{self.tmp.name}/w{i}.sock" for i in range(2)]
        self.workers = [WorkerProcess(ep, self.tmp.name, f"w{i}")
                        for i, ep in enumerate(self.endpoints)]

    def tearDown(self):
        for w in self.workers:
            w.stop()
        self.tmp.cleanup()

    def test_killed_and_restarted_worker_gets_its_weights_back_via_ensure_weights(self):
        weights = make_weights(seed=11)
        with VrollClient(self.endpoints, timeout_s=3, linger_ms=0) as client:
            client.push_weights(weights, version=5, rope_layout=None)
            self.workers[1].kill()

            # Requests to the dead worker time out and name it; the live one keeps serving.
            with self.assertRaises(VrollTimeoutError) as cm:
                client.generate([[1, 2]] * 4, SamplingParams(max_tokens=4))
            self.assertEqual(cm.exception.worker, self.endpoints[1])
            outs = client.generate([[1, 2]] * 2, SamplingParams(max_tokens=4),
                                   endpoints=[self.endpoints[0]])
            self.assertEqual([o.outputs[0].policy_version for o in outs], [5, 5])

            self.workers[1] = WorkerProcess(self.endpoints[1], self.tmp.name, "w1-restarted")
            client.timeout_s = 60
            health = client.health()
            self.assertEqual([h["policy_version"] for h in health.values()], [5, 0])
            # The dead worker's backlog was dropped on timeout, not replayed to the new one.
            stats = client.stats([self.endpoints[1]])[self.endpoints[1]]
            self.assertEqual(stats["num_running"] + stats["num_waiting"] +
                             stats["num_finished_samples"], 0)

            acks = client.ensure_weights(weights, version=5, rope_layout=None)
            self.assertEqual([a.worker for a in acks], [self.endpoints[1]])
            self.assertEqual(acks[0].weights_checksum, weights_checksum(weights))
            self.assertEqual([h["policy_version"] for h in client.health().values()], [5, 5])
            self.assertEqual(client.ensure_weights(weights, version=5, rope_layout=None), [])

            outs = client.generate([[1, 70]] * 4, SamplingParams(max_tokens=5, seed=4),
                                   min_policy_version=5)
            self.assertEqual({o.worker for o in outs}, set(self.endpoints))
            self.assertEqual({o.outputs[0].policy_version for o in outs}, {5})
            self.assertEqual(len({tuple(o.outputs[0].token_ids) for o in outs}), 1)


@unittest.skipUnless(WORKER, SKIP_REASON)
class SlowPeerTest(unittest.TestCase):
    """A real worker whose update_timeout_ms (1 s) is shorter than the wait for a slow second
    worker (a FakeWorker with the default model's parameters): push_weights keeps the real
    worker's update open, so the push applies on both, not on the slow one only."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="vroll-e2e-")
        self.worker = WorkerProcess(f"ipc://{self.tmp.name}/w.sock", self.tmp.name, "w",
                                    ["--update-timeout-ms", "1000"],
                                    env={"VROLL_LOG_LEVEL": "info"})  # its log is checked
        from fake_worker import FakeWorker  # tests/transport/python, on PYTHONPATH
        self.fake = FakeWorker(default_model_shapes())
        self.client = VrollClient([self.worker.endpoint, self.fake.endpoint], timeout_s=30,
                                  linger_ms=0)

    def tearDown(self):
        self.client.close(linger_ms=0)
        self.fake.stop()
        self.worker.stop()
        self.tmp.cleanup()

    def check_applied(self, acks, weights, version):
        self.assertEqual([(a.worker, a.stage, a.version) for a in acks],
                         [(self.worker.endpoint, "applied", version),
                          (self.fake.endpoint, "applied", version)])
        self.assertEqual({a.weights_checksum for a in acks}, {weights_checksum(weights)})
        self.assertEqual([h["policy_version"] for h in self.client.health().values()],
                         [version, version])
        out = self.client.generate([1, 2], SamplingParams(max_tokens=2),
                                   endpoints=[self.worker.endpoint])
        self.assertEqual(out[0].outputs[0].policy_version, version)

    def test_a_verified_worker_outwaits_a_slow_one(self):
        weights = make_weights(seed=21)
        self.fake.verify_delay_s = 3.0  # three of the real worker's update timeouts
        start = time.monotonic()
        self.check_applied(self.client.push_weights(weights, version=1, rope_layout=None), weights, 1)
        self.assertGreaterEqual(time.monotonic() - start, 3.0)
        # The same update stayed open: the commit was repeated, and it never timed out.
        self.assertIn("update_commit repeated on a verified update", self.worker.log())
        self.assertNotIn("had no message for", self.worker.log())

    def test_a_worker_stopped_past_its_timeout_before_the_apply_still_applies(self):
        # The worker is stopped (a VM pause, SIGSTOP) for twice its update_timeout_ms just as the
        # apply is sent: on waking it must read that apply before it declares the update timed
        # out; else the push applies on the other worker only.
        weights = make_weights(seed=23)
        original = self.client._send
        pid = self.worker.proc.pid

        def stopping_send(worker, header, frames=(), request="", **kwargs):
            if header["type"] == "update_apply" and worker.endpoint == self.worker.endpoint:
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(2.0, os.kill, (pid, signal.SIGCONT)).start()
            return original(worker, header, frames, request, **kwargs)

        self.client._send = stopping_send
        try:
            acks = self.client.push_weights(weights, version=1, rope_layout=None)
        finally:
            self.client._send = original
            os.kill(pid, signal.SIGCONT)
        self.check_applied(acks, weights, 1)
        self.assertNotIn("had no message for", self.worker.log())

    def test_a_begun_worker_outwaits_a_busy_one(self):
        weights = make_weights(seed=22)
        self.fake.busy_begins = 6  # asked again after 0.05 + 0.1 + ... + 1 s: about 2.5 s
        start = time.monotonic()
        self.check_applied(self.client.push_weights(weights, version=1, rope_layout=None), weights, 1)
        self.assertGreaterEqual(time.monotonic() - start, 2.0)
        self.assertEqual(self.fake.types().count("update_begin"), 7)
        # The same update stayed open: its begin was repeated, and it never timed out.
        self.assertIn("repeated update_begin acknowledged again", self.worker.log())
        self.assertNotIn("had no message for", self.worker.log())


@unittest.skipUnless(WORKER, SKIP_REASON)
class ReplyQueueTest(unittest.TestCase):
    """A client that does not read, against --max-queued-replies 16: replies beyond its queue are
    dropped with a warning naming the flag, at most one a second with the count so far (drops
    held back by that second are reported after it); the worker goes on serving a client that
    reads (whose bursts stay under the bound: with 1, even its `accepted` and two samples
    finishing in one step overflow it, see docs/PROTOCOL.md)."""

    def test_dropped_replies_are_warned_about_at_most_once_a_second(self):
        import msgpack
        import zmq
        with tempfile.TemporaryDirectory(prefix="vroll-e2e-") as tmp:
            endpoint = f"ipc://{tmp}/w.sock"
            worker = WorkerProcess(endpoint, tmp, "w", ["--max-queued-replies", "16"])
            ctx = zmq.Context()
            try:
                silent = ctx.socket(zmq.DEALER)
                silent.setsockopt(zmq.LINGER, 0)
                silent.setsockopt(zmq.RCVHWM, 1)
                silent.setsockopt(zmq.RCVBUF, 4096)
                silent.connect(endpoint)
                for i in range(100):
                    silent.send(msgpack.packb({
                        "v": 1, "type": "generate", "id": f"g{i}", "request_id": f"r{i}",
                        "prompt": [1, 65], "n": 4,
                        "sampling": {"max_new_tokens": 60, "seed": i}}))
                def warnings():
                    return [l for l in worker.log().splitlines() if "replies dropped so far" in l]

                # The 400 samples finish within about a second here: most drops come inside the
                # first warning's second, and are reported by a second warning once it is over.
                start = time.monotonic()
                while len(warnings()) < 2 and time.monotonic() - start < 20:
                    time.sleep(0.1)
                elapsed = time.monotonic() - start
                warnings = warnings()
                self.assertGreaterEqual(len(warnings), 2, worker.log())
                self.assertIn("--max-queued-replies", warnings[0])
                # Hundreds of replies are dropped (400 samples, 100 accepted), yet the warnings
                # come at most once a second, each with the running count.
                self.assertLessEqual(len(warnings), int(elapsed) + 1, warnings)
                counts = [int(l.split("; ")[1].split()[0]) for l in warnings]
                self.assertEqual(counts, sorted(counts))
                self.assertGreater(counts[-1], 10 * len(warnings), warnings)
                with VrollClient([endpoint], timeout_s=60) as client:
                    outs = client.generate([[1, 2, 3]], SamplingParams(max_tokens=5), n=2)
                    self.assertEqual([len(c.token_ids) for c in outs[0].outputs], [5, 5])
                worker.stop()
                # The total at exit, drops after the last warning included.
                final = [l for l in worker.log().splitlines() if "dropped at full queues in all" in l]
                self.assertEqual(len(final), 1, worker.log())
                total = int(final[0].split("; ")[1].split()[0])
                self.assertGreaterEqual(total, counts[-1], final)
            finally:
                ctx.destroy(linger=0)
                worker.stop()


@unittest.skipUnless(WORKER, SKIP_REASON)
@unittest.skipUnless(WORKER, SKIP_REASON)
class RoutingIdTest(unittest.TestCase):
    """libzmq 4.3.4's ROUTER names a connection that sets no routing id 0x00 + a 32-bit counter
    started from rand() and does not check it against ids that peers claimed (ZMQ_ROUTING_ID): a
    collision aborts the process (assertion in socket_base.cpp). With rand() unseeded every worker
    started the same way handed out the same ids, so any peer could claim the next one and take the
    worker down (helper-66, with a generate-only CURVE key too). The worker seeds rand()."""

    def test_peers_cannot_claim_the_routing_id_the_next_connection_gets(self):
        tmp = tempfile.TemporaryDirectory(prefix="vroll-rid-")
        self.addCleanup(tmp.cleanup)
        endpoint = f"ipc://{tmp.name}/w.sock"
        env = {"VROLL_LOG_LEVEL": "info"}  # "paused by peer ID" names the first connection's id
        first = WorkerProcess(endpoint, tmp.name, "first", env=env)
        client = VrollClient(endpoint, timeout_s=30, linger_ms=0)
        try:
            client.pause()
            client.resume()
        finally:
            client.close(linger_ms=0)
            first.stop()
        match = re.search(r"paused by peer ([0-9a-f]{10})\b", first.log())
        self.assertIsNotNone(match, first.log())
        first_id = int(match.group(1), 16)
        # A second worker, started the same way: claim the ids its first connections got last
        # time, then connect as an ordinary client.
        second = WorkerProcess(endpoint, tmp.name, "second", env=env)
        self.addCleanup(second.stop)
        ctx = zmq.Context.instance()
        claimers = []
        for k in range(16):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, (first_id + k).to_bytes(5, "big"))
            s.connect(endpoint)
            claimers.append(s)
        self.addCleanup(lambda: [c.close(0) for c in claimers])
        time.sleep(0.5)  # let the claiming connections complete their handshakes
        client = VrollClient(endpoint, timeout_s=10, linger_ms=0)
        try:
            health = client.health()[endpoint]
            self.assertTrue(health["ok"])
            outs = client.generate([[1, 72]], SamplingParams(max_tokens=4, seed=1), n=2)
            self.assertEqual([len(c.token_ids) for c in outs[0].outputs], [4, 4])
        except VrollTimeoutError as e:
            time.sleep(0.5)
            self.fail(f"{e}; the worker's exit status: {second.proc.poll()}; log:\n{second.log()[-1500:]}")
        finally:
            client.close(linger_ms=0)
        self.assertIsNone(second.proc.poll(), f"the worker exited; log:\n{second.log()}")


class CurveTest(unittest.TestCase):
    def test_trainer_key_may_push_and_client_key_may_only_generate(self):
        def keypair_with_hash():
            # '#' is a Z85 digit (about 31% of keys hold one): key files must not cut it off.
            return next(k for k in iter(curve_keypair, None) if "#" in k[0] and "#" in k[1])

        with tempfile.TemporaryDirectory(prefix="vroll-e2e-") as tmp:
            worker_pub, worker_key = keypair_with_hash()
            trainer, sampler = keypair_with_hash(), keypair_with_hash()
            files = {"worker.key": worker_key, "trainers.txt": f"{trainer[0]}  # trainer-0",
                     "clients.txt": sampler[0]}
            for name, text in files.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text + "\n")
            endpoint = f"ipc://{tmp}/curve.sock"
            worker = WorkerProcess(endpoint, tmp, "curve", [
                "--curve-secret-key", os.path.join(tmp, "worker.key"),
                "--curve-trainer-keys", os.path.join(tmp, "trainers.txt"),
                "--curve-client-keys", os.path.join(tmp, "clients.txt")])
            try:
                with VrollClient(endpoint, curve_server_key=worker_pub, curve_client_keys=trainer,
                                 timeout_s=60) as client:
                    self.assertEqual(client.push_weights(make_weights(1), version=1, rope_layout=None)[0].version, 1)
                with VrollClient(endpoint, curve_server_key=worker_pub, curve_client_keys=sampler,
                                 timeout_s=60) as client:
                    out = client.generate([[1, 2]], SamplingParams(max_tokens=3))
                    self.assertEqual(out[0].outputs[0].policy_version, 1)
                    with self.assertRaises(WeightUpdateError) as cm:
                        client.push_weights(make_weights(2), version=2, rope_layout=None)
                    self.assertEqual(cm.exception.failures[endpoint].code, "unauthorized")
                    with self.assertRaises(WorkerError) as cm:
                        client.pause()
                    self.assertEqual(cm.exception.code, "unauthorized")
                stranger = curve_keypair()
                with VrollClient(endpoint, curve_server_key=worker_pub,
                                 curve_client_keys=stranger, timeout_s=1, linger_ms=0) as client:
                    with self.assertRaises(VrollTimeoutError) as cm:
                        client.health()
                    # Only a timeout shows: the message says what it may mean (helper-67).
                    self.assertIn("does not allow this client's CURVE key", str(cm.exception))
                with VrollClient(endpoint, timeout_s=1, linger_ms=0) as client:  # no keys at all
                    with self.assertRaises(VrollTimeoutError) as cm:
                        client.health()
                    self.assertIn("a worker running CURVE looks like to a client without keys", str(cm.exception))
            finally:
                worker.stop()


if __name__ == "__main__":
    unittest.main()
