"""Python client of vroll workers (docs/PROTOCOL.md): generation with per-token logprobs and
policy versions, two-phase weight updates, control. The API follows vLLM where it can:

    from vroll_client import VrollClient, SamplingParams

    with VrollClient(["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"]) as client:
        outs = client.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=64), n=8)
        for sample in outs[0].outputs:
            print(sample.token_ids, sample.logprobs, sample.policy_version)
        acks = client.push_weights(model.state_dict(), version=1)

Only numpy, pyzmq, msgpack and xxhash are needed; torch tensors are accepted when torch is used.
"""
from .client import VrollClient
from .curve import client_keys_from_secret, curve_keypair, curve_public_key, read_curve_key_file
from .types import (CompletionOutput, RequestOutput, SamplingParams, UpdateAck, VrollError,
                    VrollTimeoutError, WeightUpdateError, WorkerError)
from .weights import WireTensor, chunk_ranges, tensor_checksum, to_wire, weights_checksum

__all__ = [
    "CompletionOutput", "RequestOutput", "SamplingParams", "UpdateAck", "VrollClient",
    "VrollError", "VrollTimeoutError", "WeightUpdateError", "WireTensor", "WorkerError",
    "chunk_ranges", "client_keys_from_secret", "curve_keypair", "curve_public_key",
    "read_curve_key_file", "tensor_checksum", "to_wire", "weights_checksum",
]

