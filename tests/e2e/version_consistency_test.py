#!/usr/bin/python3
"""Version-consistency suite: real vroll-worker processes, a separate trainer process pushing K
versions with random weight perturbations while requests flow, under each in-flight mode.

Oracle: every sample's logprobs are recomputed by an independent implementation (the PyTorch model
in examples/python/vroll_llama.py) under the weights of EVERY version; each output span must match
the version it is tagged with (<= 1e-4) and not its neighbours. Also: no sample lost or duplicated,
bounded time (no deadlock), a trainer killed mid-update leaves the worker on the old version and
serving, and a worker killed and restarted is re-sent the current weights by the client.

Run by ctest with VROLL_WORKER=<path to vroll-worker>; skipped without it.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "examples", "python"))
sys.path.insert(0, os.path.join(REPO, "transport", "python"))

from local_worker import start_worker, stop_worker  # noqa: E402
from vroll_client import SamplingParams, VrollClient  # noqa: E402
from vroll_llama import DEFAULT_CONFIG, Llama  # noqa: E402

WORKER = os.environ.get("VROLL_WORKER")
NUM_VERSIONS = 4  # pushed by the trainer process after the initial version 1
TOL = 1e-4
WORKER_EXTRA = [[], ["--no-spare-weights"]]  # per worker: its weight-update apply path


def version_weights(version, seed=1234):
    """Version 1: a seeded random model of the default shape; version k > 1: version k-1 plus
    N(0, 0.05^2) noise on every weight. Deterministic, so trainer and test agree."""
    model = Llama(DEFAULT_CONFIG).init_random(seed, std=0.08)
    weights = model.hf_state_dict()
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(2, version + 1):
        weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sorted(weights.items())}
    return {k: v.contiguous() for k, v in weights.items()}


class Recomputer:
    """Logprobs of output tokens under each version's weights (PyTorch, full-sequence forward)."""

    def __init__(self, max_version):
        self.models = {}
        for v in range(1, max_version + 1):
            m = Llama(DEFAULT_CONFIG)
            with torch.no_grad():
                for name, t in version_weights(v).items():
                    m.p[name.replace(".", "__")].copy_(t)
            self.models[v] = m

        self.cache = {}  # (version, prompt, output) -> logprobs, filled by warm()

    def logprobs(self, version, prompt, output):
        key = (version, tuple(prompt), tuple(output))
        if key in self.cache:
            return self.cache[key]
        with torch.no_grad():
            lp, _ = self.models[version].token_logprobs([list(prompt) + list(output)], [len(prompt)])
        return lp[0, : len(output)].tolist()

    def warm(self, items, batch_size=64):
        """Computes the logprobs of every (version, prompt, output) in `items` in batched forwards
        (right-padded: causal attention keeps padding out of earlier positions) for logprobs() to
        look up. One forward per sample and version took ~3 of the suite's ~3.5 minutes in CI
        (Debian's torch runs a generic BLAS on one thread by default)."""
        by_version = {}
        for version, prompt, output in items:
            if output and version in self.models:
                by_version.setdefault(version, set()).add((tuple(prompt), tuple(output)))
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, os.cpu_count() or 1))
        try:
            with torch.no_grad():
                for version, pairs in by_version.items():
                    unique = sorted(pairs, key=lambda po: len(po[0]) + len(po[1]))
                    for i in range(0, len(unique), batch_size):
                        batch = unique[i : i + batch_size]
                        lp, _ = self.models[version].token_logprobs([list(p) + list(o) for p, o in batch],
                                                                    [len(p) for p, _ in batch])
                        for row, (p, o) in zip(lp, batch):
                            self.cache[(version, p, o)] = row[: len(o)].tolist()
        finally:
            torch.set_num_threads(threads)


def check_sample(test, rec, prompt, completion, max_version):
    """Each version span matches its tagged version and not the neighbours."""
    out = list(completion.token_ids)
    got = list(completion.logprobs)
    test.assertEqual(len(got), len(out))
    if not out:
        return 0
    spans = completion.version_spans or [(0, len(out), completion.policy_version)]
    test.assertEqual(spans[0][0], 0)
    test.assertEqual(spans[-1][1], len(out))
    for begin, end, version in spans:
        want = rec.logprobs(version, prompt, out)
        diff = max(abs(a - b) for a, b in zip(got[begin:end], want[begin:end]))
        test.assertLessEqual(diff, TOL, f"span [{begin},{end}) tagged v{version}: max diff {diff}")
        for neighbour in (version - 1, version + 1):
            if 1 <= neighbour <= max_version:
                other = rec.logprobs(neighbour, prompt, out)
                ndiff = max(abs(a - b) for a, b in zip(got[begin:end], other[begin:end]))
                test.assertGreater(ndiff, TOL, f"span tagged v{version} also matches v{neighbour}")
    return len(spans)


TRAINER_SCRIPT = r"""
import sys, time
sys.path[:0] = [{paths}]
from version_consistency_test import version_weights
from vroll_client import VrollClient
client = VrollClient({endpoints!r}, timeout_s=120)
for v in range(2, {last} + 1):
    time.sleep({interval})
    acks = client.push_weights(version_weights(v), v, mode={mode!r}, rope_layout='interleaved')
    print("pushed", v, [a.version for a in acks], flush=True)
"""

KILLED_TRAINER_SCRIPT = r"""
import os, signal, sys
sys.path[:0] = [{paths}]
import msgpack, zmq
from version_consistency_test import version_weights
w = version_weights({version})
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect({endpoint!r})
import xxhash
tensors = [dict(name=k, dtype="float32", shape=list(t.shape), num_bytes=t.numel() * 4,
                checksum=xxhash.xxh3_64_intdigest(t.numpy().tobytes())) for k, t in sorted(w.items())]
s.send(msgpack.packb(dict(v=1, type="update_begin", id="b", update_id="doomed", version={version},
                          mode="drain", partial=False, tensors=tensors)))
print(msgpack.unpackb(s.recv()), flush=True)
name, t = sorted(w.items())[0]
data = t.numpy().tobytes()
s.send_multipart([msgpack.packb(dict(v=1, type="update_chunk", update_id="doomed", name=name, offset=0)),
                  data[: len(data) // 2]])
import time; time.sleep(0.2)
os.kill(os.getpid(), signal.SIGKILL)
"""


@unittest.skipUnless(WORKER, "VROLL_WORKER is not set (ctest sets it)")
class VersionConsistencyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rec = Recomputer(1 + NUM_VERSIONS)
        cls.paths = ", ".join(repr(p) for p in (HERE, os.path.join(REPO, "examples", "python"),
                                                 os.path.join(REPO, "transport", "python")))

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="vroll-e2e-")
        self.addCleanup(self.tmp.cleanup)
        self.workers, self.endpoints = [], []
        self.addCleanup(lambda: [stop_worker(w) for w in self.workers])
        # Worker 1 applies updates in place (--no-spare-weights: copy + repack at the safe point),
        # worker 0 by swapping spare buffers packed while staged (the default): both apply paths
        # are held to the same oracle. Each binds a port of the kernel's choosing (tcp://...:*).
        for i in range(2):
            proc, endpoint = self.start_worker(i)
            self.workers.append(proc)
            self.endpoints.append(endpoint)
        self.client = VrollClient(self.endpoints, timeout_s=60)
        self.client.wait_ready(timeout_s=60)
        self.client.push_weights(version_weights(1), 1, rope_layout='interleaved')

    def start_worker(self, i, endpoint="tcp://127.0.0.1:*"):
        return start_worker(WORKER, ["--kv-cache-mb", "32", "--update-timeout-ms", "1500", *WORKER_EXTRA[i]],
                            log_path=os.path.join(self.tmp.name, f"worker{i}.log"), endpoint=endpoint)

    def tearDown(self):
        self.client.close()

    def prompts(self, k, offset):
        return [[1] + [3 + (offset * 7 + i * 13 + j * 5) % 256 for j in range(3 + (i + offset) % 9)] for i in range(k)]

    def run_mode(self, mode):
        last = 1 + NUM_VERSIONS
        trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER_SCRIPT.format(paths=self.paths, endpoints=self.endpoints, last=last,
                                                         mode=mode, interval=0.3)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 240
        results = []
        round_ = 0
        sampling = SamplingParams(temperature=1.0, max_tokens=24)
        while trainer.poll() is None or round_ < 2:
            self.assertLess(time.time(), deadline, "requests did not finish in time (deadlock?)")
            prompts = self.prompts(6, round_)
            outs = self.client.generate(prompts, sampling, n=3)
            self.assertEqual(len(outs), len(prompts))
            for prompt, out in zip(prompts, outs):
                self.assertEqual(sorted(c.index for c in out.outputs), [0, 1, 2], "lost or duplicated samples")
                results.extend((prompt, c) for c in out.outputs)
            round_ += 1
            if trainer.poll() is not None:
                round_ = max(round_, 1)
        log = trainer.stdout.read()
        trainer.stdout.close()
        self.assertEqual(trainer.returncode, 0, log)
        health = self.client.health()  # {endpoint: reply}
        self.rec.warm([(v + d, prompt, c.token_ids) for prompt, c in results
                       for v in {s[2] for s in (c.version_spans or [(0, 0, c.policy_version)])} for d in (-1, 0, 1)])
        versions_seen = set()
        spans_checked = 0
        mixed = 0
        for prompt, c in results:
            spans_checked += check_sample(self, self.rec, prompt, c, last)
            versions_seen.update(s[2] for s in (c.version_spans or [(0, 0, c.policy_version)]))
            mixed += len(c.version_spans) > 1
        print(f"\n  {mode}: {len(results)} samples, {spans_checked} spans checked against 3 versions each, "
              f"versions seen {sorted(versions_seen)}, {mixed} with mixed versions", file=sys.stderr)
        self.assertGreater(spans_checked, 0, "no sample had output tokens to check")
        for endpoint, reply in health.items():
            self.assertEqual(reply["policy_version"], last, endpoint)
        self.assertGreaterEqual(len(versions_seen), 2, f"requests never overlapped an update: {versions_seen}")
        return results, spans_checked

    def test_drain(self):
        results, _ = self.run_mode("drain")
        for _, c in results:
            self.assertLessEqual(len(c.version_spans), 1, "drain never mixes versions")

    def test_abort(self):
        results, _ = self.run_mode("abort")
        for _, c in results:
            self.assertLessEqual(len(c.version_spans), 1)

    def test_restart(self):
        results, _ = self.run_mode("restart")
        for _, c in results:
            self.assertLessEqual(len(c.version_spans), 1)

    def test_continue(self):
        self.run_mode("continue")

    def test_trainer_killed_mid_update_leaves_worker_on_old_version_and_serving(self):
        endpoint = self.endpoints[0]
        proc = subprocess.run(
            [sys.executable, "-c", KILLED_TRAINER_SCRIPT.format(paths=self.paths, endpoint=endpoint, version=2)],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, -signal.SIGKILL, proc.stdout + proc.stderr)
        self.assertIn("begun", proc.stdout)
        time.sleep(2.0)  # past --update-timeout-ms 1500: the worker aborts the staged update
        prompt = self.prompts(1, 99)
        self.assertEqual(self.client.health([endpoint])[endpoint]["policy_version"], 1)
        out = self.client.generate(prompt, SamplingParams(max_tokens=8), n=2, endpoints=[endpoint])
        for c in out[0].outputs:
            self.assertEqual(c.policy_version, 1)
            check_sample(self, self.rec, prompt[0], c, 2)
        acks = self.client.push_weights(version_weights(2), 2, rope_layout='interleaved')  # a new update still works
        self.assertTrue(all(a.version == 2 for a in acks))

    def test_worker_killed_and_restarted_gets_current_weights_again(self):
        self.client.push_weights(version_weights(2), 2, rope_layout='interleaved')
        self.workers[1].kill()
        self.workers[1].wait()
        self.workers[1], _ = self.start_worker(1, self.endpoints[1])  # the port it had: the client reconnects
        deadline = time.time() + 60
        while True:
            try:
                self.client.ensure_weights(version_weights(2), 2, rope_layout='interleaved')
                break
            except Exception:  # noqa: BLE001 - the restarted worker is not up yet
                self.assertLess(time.time(), deadline, "restarted worker never came back")
                time.sleep(0.3)
        prompts = self.prompts(6, 5)
        outs = self.client.generate(prompts, SamplingParams(max_tokens=12), n=2)
        for prompt, out in zip(prompts, outs):
            for c in out.outputs:
                self.assertEqual(c.policy_version, 2)
                check_sample(self, self.rec, prompt, c, 3)


if __name__ == "__main__":
    unittest.main()
