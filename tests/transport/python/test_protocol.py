"""Pure tests of the client's message encoding against docs/PROTOCOL.md. No worker needed."""
import os
import re
import unittest

import msgpack

from vroll_client import CompletionOutput, SamplingParams, UpdateAck, WorkerError, protocol

PROTOCOL_MD = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "PROTOCOL.md")


def doc_sections():
    """{section title: set of `backticked` words in it} of docs/PROTOCOL.md."""
    with open(PROTOCOL_MD, encoding="utf-8") as f:
        text = f.read()
    sections = {}
    for chunk in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = chunk.partition("\n")
        sections[title.strip()] = set(re.findall(r"`\"?([A-Za-z_][A-Za-z0-9_]*)\"?`", body))
    return sections


def keys_of(header, path=""):
    """Every map key in a header, nested maps and arrays of maps included."""
    out = set()
    items = header.items() if isinstance(header, dict) else enumerate(header)
    for k, v in items:
        if isinstance(k, str):
            out.add(k)
        if isinstance(v, (dict, list)):
            out |= keys_of(v)
    return out


class RecordingDict(dict):
    """A reply whose reads are recorded, to list the fields the client reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


class EncodingMatchesDocTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sections = doc_sections()
        cls.common = cls.sections["Common header fields"]

    def assert_documented(self, header, section):
        documented = self.common | self.sections[section]
        self.assertEqual(keys_of(header) - documented, set(),
                         f"fields missing from PROTOCOL.md section '{section}'")
        self.assertIn(header["type"], documented)

    def test_generate_fields(self):
        sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=32,
                            stop_token_ids=[2], include_stop_token=False, seed=11)
        header = protocol.make_generate("r1", [1, 2, 3], 4, sp.to_wire(), 3)
        self.assertEqual(header, {
            "v": 1, "type": "generate", "id": "r1", "request_id": "r1", "prompt": [1, 2, 3],
            "n": 4, "min_policy_version": 3,
            "sampling": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 32,
                         "stop_token_ids": [2], "include_stop_token": False, "seed": 11}})
        self.assert_documented(header, "generate")

    def test_sampling_defaults_and_seed_omitted_when_none(self):
        self.assertEqual(SamplingParams().to_wire(), {
            "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 16,
            "stop_token_ids": [], "include_stop_token": True})

    def test_numpy_token_ids_become_ints_and_floats_are_refused(self):
        import numpy as np

        header = protocol.make_generate("r", np.array([5, 6], dtype=np.int64))
        self.assertEqual(header["prompt"], [5, 6])
        self.assertIs(type(header["prompt"][0]), int)
        msgpack.packb(header)  # packable
        with self.assertRaisesRegex(TypeError, r"prompt\[1\] = 2.5"):
            protocol.make_generate("r", [1, 2.5])
        with self.assertRaisesRegex(TypeError, r"stop_token_ids\[0\]"):
            SamplingParams(stop_token_ids=["x"]).to_wire()

    def test_sampling_argument_errors_name_the_field(self):
        cases = [
            ({"temperature": "hot"}, TypeError, "sampling.temperature = 'hot' must be a number"),
            ({"temperature": True}, TypeError, "sampling.temperature = True must be a number"),
            ({"top_p": None}, TypeError, "sampling.top_p = None must be a number"),
            ({"max_tokens": "5"}, TypeError, "sampling.max_tokens = '5' must be an int"),
            ({"max_tokens": True}, TypeError, "sampling.max_tokens = True must be an int"),
            ({"max_tokens": 5.0}, TypeError, "sampling.max_tokens = 5.0 must be an int"),
            ({"top_k": 1.5}, TypeError, "sampling.top_k = 1.5 must be an int"),
            ({"seed": "7"}, TypeError, "sampling.seed = '7' must be an int"),
            ({"seed": 2 ** 64}, ValueError,
             "sampling.seed = 18446744073709551616 must be in [0, 2**64)"),
            ({"seed": -1}, ValueError, "sampling.seed = -1 must be in [0, 2**64)"),
            ({"max_tokens": 2 ** 64}, ValueError,
             "sampling.max_tokens = 18446744073709551616 must be in [-2**63, 2**64)"),
            ({"temperature": 10 ** 400}, ValueError, "sampling.temperature = 1" + "0" * 400 +
             " is too large for a float"),
            ({"include_stop_token": "false"}, TypeError,
             "sampling.include_stop_token = 'false' must be a bool"),
            ({"include_stop_token": 2}, TypeError, "sampling.include_stop_token = 2 must be a bool"),
            ({"include_stop_token": None}, TypeError,
             "sampling.include_stop_token = None must be a bool"),
        ]
        for kwargs, error, message in cases:
            with self.subTest(repr(kwargs)[:60]):
                with self.assertRaises(error) as cm:
                    SamplingParams(**kwargs).to_wire()
                self.assertEqual(str(cm.exception), message)

    def test_vllm_logprobs_and_stop_options_are_accepted_only_where_they_mean_what_vroll_does(self):
        import numpy as np

        # vLLM's logprobs=0 (the sampled tokens' logprobs) and an empty stop list: what vroll does
        # anyway; nothing extra goes on the wire.
        for kwargs in ({"logprobs": None}, {"logprobs": 0}, {"logprobs": np.int64(0)}, {"stop": None},
                       {"stop": []}, {"ignore_eos": True}, {"ignore_eos": None}):
            with self.subTest(repr(kwargs)):
                self.assertEqual(SamplingParams(**kwargs).to_wire(), SamplingParams().to_wire())
        cases = [
            ({"logprobs": 1}, ValueError, "SamplingParams.logprobs = 1: vroll does not compute the 1 most likely"),
            ({"logprobs": 5}, ValueError, "SamplingParams.logprobs = 5: vroll does not compute the 5 most likely"),
            ({"logprobs": True}, TypeError, "SamplingParams.logprobs = True must be None or an int"),
            ({"logprobs": "0"}, TypeError, "SamplingParams.logprobs = '0' must be None or an int"),
            ({"stop": ["\n"]}, ValueError, "SamplingParams.stop = ['\\n']: vroll works on token ids"),
            ({"stop": "The end"}, ValueError, "SamplingParams.stop = 'The end': vroll works on token ids"),
            ({"ignore_eos": False}, ValueError, "SamplingParams.ignore_eos = False: no token ends a sample here"),
        ]
        for kwargs, error, message in cases:
            with self.subTest(repr(kwargs)):
                with self.assertRaises(error) as cm:
                    SamplingParams(**kwargs)  # at construction, before any request is made
                self.assertTrue(str(cm.exception).startswith(message), str(cm.exception))
        self.assertIn("CompletionOutput.logprobs", str(self._error(logprobs=2)))
        self.assertIn("stop_token_ids", str(self._error(stop=["x"])))

    @staticmethod
    def _error(**kwargs):
        try:
            SamplingParams(**kwargs)
        except (TypeError, ValueError) as e:
            return e
        return None

    def test_include_stop_token_takes_bools_and_0_or_1(self):
        import numpy as np

        for value, expected in ((True, True), (False, False), (1, True), (0, False),
                                (np.bool_(False), False), (np.int64(1), True)):
            with self.subTest(repr(value)):
                wire = SamplingParams(include_stop_token=value).to_wire()
                self.assertIs(wire["include_stop_token"], expected)

    def test_sampling_takes_numpy_scalars_and_the_whole_uint64_seed_range(self):
        import numpy as np

        wire = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.25),
                              top_k=np.int32(3), max_tokens=np.int64(7),
                              seed=np.uint64(2 ** 64 - 1)).to_wire()
        self.assertEqual(wire, {"temperature": 0.5, "top_p": 0.25, "top_k": 3,
                                "max_new_tokens": 7, "stop_token_ids": [],
                                "include_stop_token": True, "seed": 2 ** 64 - 1})
        for key in ("temperature", "top_p"):
            self.assertIs(type(wire[key]), float)
        for key in ("top_k", "max_new_tokens", "seed"):
            self.assertIs(type(wire[key]), int)
        self.assertEqual(msgpack.unpackb(msgpack.packb(wire))["seed"], 2 ** 64 - 1)
        self.assertEqual(SamplingParams(temperature=0, seed=0).to_wire()["temperature"], 0.0)

    def test_abort_fields(self):
        header = protocol.make_abort("r1", "a1")
        self.assertEqual(header, {"v": 1, "type": "abort", "id": "a1", "request_id": "r1"})
        self.assert_documented(header, "generate")

    def test_update_messages(self):
        entry = protocol.make_manifest_entry("model.norm.weight", "bfloat16", (64,), 128, 7)
        begin = protocol.make_update_begin("u1", 5, [entry], "restart", True, "i0")
        self.assertEqual(begin, {
            "v": 1, "type": "update_begin", "id": "i0", "update_id": "u1", "version": 5,
            "mode": "restart", "partial": True,
            "tensors": [{"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64],
                         "num_bytes": 128, "checksum": 7}]})
        declared = protocol.make_update_begin("u1", 5, [entry], id_="i0", rope_layout="half_split")
        self.assertEqual(declared["rope_layout"], "half_split")
        self.assert_documented(declared, "Weight updates")
        chunk = protocol.make_update_chunk("u1", "model.norm.weight", 64, "i1")
        self.assertEqual(chunk, {"v": 1, "type": "update_chunk", "id": "i1", "update_id": "u1",
                                 "name": "model.norm.weight", "offset": 64})
        commit = protocol.make_update_commit("u1", False, "i2")
        self.assertEqual(commit, {"v": 1, "type": "update_commit", "id": "i2",
                                  "update_id": "u1", "apply": False})
        apply = protocol.make_update_apply("u1", "i3")
        self.assertEqual(apply, {"v": 1, "type": "update_apply", "id": "i3", "update_id": "u1"})
        abort = protocol.make_update_abort("u1", "i4")
        self.assertEqual(abort, {"v": 1, "type": "update_abort", "id": "i4", "update_id": "u1"})
        for header in (begin, chunk, commit, apply, abort):
            with self.subTest(type=header["type"]):
                self.assert_documented(header, "Weight updates")
                for value in header.values():  # tensor bytes never ride in the header
                    self.assertNotIsInstance(value, (bytes, bytearray, memoryview))
        self.assertEqual(set(protocol.UPDATE_MODES) - self.sections["Weight updates"], set())
        self.assertEqual(set(protocol.WIRE_DTYPES) - self.sections["Weight updates"], set())

    def test_control_messages_and_reply_types(self):
        for type_, reply in protocol.CONTROL_REPLIES.items():
            with self.subTest(type=type_):
                header = protocol.make_control(type_, "c")
                self.assertEqual(header, {"v": 1, "type": type_, "id": "c"})
                self.assert_documented(header, "Control")
                self.assertIn(reply, self.sections["Control"])
        with self.assertRaises(ValueError):
            protocol.make_control("reboot")

    def test_fields_the_client_reads_are_documented(self):
        sample = RecordingDict(sample_index=0)
        CompletionOutput.from_reply(sample)
        self.assertEqual(sample.read - self.sections["generate"], set())
        ack = RecordingDict()
        UpdateAck.from_reply("w", ack)
        self.assertEqual(ack.read - self.sections["Weight updates"], set())
        error = RecordingDict()
        WorkerError.from_reply("w", error)
        self.assertEqual(error.read - self.sections["Errors"], set())

    def test_uint64_values_pack_as_unsigned(self):
        frame = protocol.encode(protocol.make_update_begin("u", 2**64 - 1, [], id_="i"))
        self.assertIn(b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", frame)  # msgpack uint64
        self.assertEqual(protocol.decode(frame)["version"], 2**64 - 1)

    def test_decode_refuses_non_maps(self):
        with self.assertRaisesRegex(ValueError, "not a map"):
            protocol.decode(msgpack.packb([1, 2]))
        with self.assertRaisesRegex(ValueError, "not msgpack"):
            protocol.decode(b"\xc1")


class ReplyParsingTest(unittest.TestCase):
    def test_sample_reply(self):
        out = CompletionOutput.from_reply({
            "type": "sample", "request_id": "r", "sample_index": 2, "output_ids": [5, 6],
            "logprobs": [-0.25, -1.5], "finish_reason": "stop", "policy_version": 3,
            "version_spans": [[0, 1, 2], [1, 2, 3]], "num_prompt_tokens": 4,
            "num_cached_prompt_tokens": 0, "future_field": 1})
        self.assertEqual((out.index, out.token_ids, out.logprobs, out.finish_reason),
                         (2, [5, 6], [-0.25, -1.5], "stop"))
        self.assertEqual((out.policy_version, out.version_spans), (3, [(0, 1, 2), (1, 2, 3)]))
        self.assertIsNone(out.error)
        self.assertEqual(out.cumulative_logprob, -1.75)  # vLLM's field: the sum of the logprobs

    def test_error_reply_message(self):
        err = WorkerError.from_reply("tcp://h:1", {"code": "bad_field", "field": "prompt[3]",
                                                   "message": "600 outside [0, 512)"}, "generate r")
        self.assertEqual((err.code, err.field, err.worker), ("bad_field", "prompt[3]", "tcp://h:1"))
        self.assertEqual(str(err), "tcp://h:1: error bad_field (prompt[3]) to generate r: "
                                   "600 outside [0, 512)")


if __name__ == "__main__":
    unittest.main()
