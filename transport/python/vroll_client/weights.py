"""Tensor packing, chunking and checksums for weight updates (policy/weight_update.h).

Pure functions over torch tensors or numpy arrays, no sockets. torch is never imported here: a
torch tensor is recognised by its type, so numpy-only callers do not pay torch's import time.

Wire conventions (all little-endian, row-major):

    dtype      bytes/elem   sent as
    float32    4            the IEEE binary32 bytes
    float16    2            the IEEE binary16 bytes
    bfloat16   2            the raw bf16 words (the upper 16 bits of a binary32); numpy has no
                            bf16, so a torch bf16 tensor is sent as tensor.view(torch.int16)

A tensor of num_bytes bytes is cut into chunks [offset, offset + length) that cover
[0, num_bytes) exactly once:

    [0 ...... chunk_bytes) [chunk_bytes ...... 2*chunk_bytes) ... [k*chunk_bytes ... num_bytes)

A boundary may split an element; the worker reassembles bytes, not elements.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any, List, Mapping, Tuple

import numpy as np
import xxhash

# 4 MiB: the worker hashes, stages and packs a chunk only once it has all of it, so smaller chunks
# overlap that work with the transfer better (and stay in cache); see docs/PROTOCOL.md, Limits.
DEFAULT_CHUNK_BYTES = 4 << 20


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class WireTensor:
    """One tensor ready to send: its protocol dtype, shape and raw bytes as sent.

    ``data`` is a flat byte memoryview over a C-contiguous little-endian buffer; for a contiguous
    CPU fp32/fp16 tensor or array it aliases the caller's memory (zero-copy), so the caller must
    not modify the tensor until the push returns. ``checksum`` is XXH3-64 (seed 0) of ``data``.
    """

    name: str
    dtype: str  # "float32" | "float16" | "bfloat16"
    shape: Tuple[int, ...]
    data: memoryview  # [num_bytes] uint8
    checksum: int

    @property
    def num_bytes(self) -> int:
        return self.data.nbytes


def _cpu_values(name: str, value: Any) -> Any:
    """A torch tensor's values on the CPU, detached, with a lazy negation applied."""
    t = value.detach()
    if t.device.type == "meta":
        raise TypeError(f"tensor {name!r} is on device 'meta': it has no values to send "
                        "(materialize it first, e.g. with load_state_dict or to_empty)")
    if t.device.type != "cpu":
        t = t.to("cpu")
    # A lazily negated view (c.conj().imag, _neg_view()) has no numpy() or view() of its own.
    return t.resolve_neg()


def _numpy_wire_array(name: str, value: Any) -> Tuple[str, np.ndarray]:
    """(protocol dtype, C-contiguous little-endian numpy array) for a tensor or array."""
    if _is_torch_tensor(value):
        import torch  # already imported by the caller: this is a dictionary lookup

        t = _cpu_values(name, value).contiguous()
        if t.dtype == torch.float32:
            return "float32", t.numpy()
        if t.dtype == torch.float16:
            return "float16", t.numpy()
        if t.dtype == torch.bfloat16:
            return "bfloat16", t.view(torch.int16).numpy()
        raise TypeError(f"tensor {name!r} has dtype {t.dtype}; weight updates carry float32, "
                        "float16 or bfloat16 (convert it, e.g. with .float())")
    if isinstance(value, np.ndarray):
        # Compare kind and size, not dtypes: a big-endian '>f4' is not == np.float32.
        kind_size = (value.dtype.kind, value.dtype.itemsize)
        if kind_size == ("f", 4):
            wire = "float32"
        elif kind_size == ("f", 2):
            wire = "float16"
        else:
            raise TypeError(f"array {name!r} has dtype {value.dtype}; weight updates carry "
                            "float32 or float16 numpy arrays (bfloat16: pass a torch tensor)")
        # asarray with order="C", not ascontiguousarray: that one turns a 0-d array into shape (1,).
        arr = np.asarray(value, dtype=value.dtype.newbyteorder("<"), order="C")
        return wire, arr
    raise TypeError(f"{name!r} is a {type(value).__name__}, not a torch.Tensor or numpy.ndarray")


def to_wire(name: str, value: Any) -> WireTensor:
    """Packs one tensor for ``update_begin``/``update_chunk``.

    Args:
      name: canonical parameter name (str).
      value: torch.Tensor (float32, float16, bfloat16; any device, any strides) or numpy.ndarray
        (float32, float16, either byte order).
    Raises:
      TypeError: another dtype or type (float64 is refused rather than silently rounded).
    Cost: zero-copy for a contiguous CPU fp32/fp16/bf16 tensor on a little-endian host, else one
    copy; plus one XXH3 pass over the bytes.
    """
    if not isinstance(name, str):
        raise TypeError(f"tensor name {name!r} is not a str")
    dtype, arr = _numpy_wire_array(name, value)
    shape = tuple(int(d) for d in arr.shape)
    data = memoryview(arr.reshape(-1).view(np.uint8))
    return WireTensor(name=name, dtype=dtype, shape=shape, data=data,
                      checksum=xxhash.xxh3_64_intdigest(data))


def tensor_checksum(data: Any) -> int:
    """TensorChecksum: XXH3-64, seed 0, of a bytes-like object (the raw bytes as sent)."""
    return xxhash.xxh3_64_intdigest(data)


def chunk_ranges(num_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> List[Tuple[int, int]]:
    """The (offset, length) chunks of a num_bytes tensor: consecutive, each ``chunk_bytes`` long
    but the last, covering [0, num_bytes) exactly once. Empty for num_bytes == 0.
    Raises ValueError for chunk_bytes < 1 or num_bytes < 0."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes = {chunk_bytes} must be >= 1")
    if num_bytes < 0:
        raise ValueError(f"num_bytes = {num_bytes} must be >= 0")
    return [(offset, min(chunk_bytes, num_bytes - offset))
            for offset in range(0, num_bytes, chunk_bytes)]


def _float32_le(name: str, value: Any) -> np.ndarray:
    """The tensor's values as a C-contiguous little-endian float32 array (exact for fp16/bf16)."""
    if _is_torch_tensor(value):
        import torch

        if value.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"tensor {name!r} has dtype {value.dtype}; expected float32, "
                            "float16 or bfloat16")
        return _cpu_values(name, value).to(dtype=torch.float32).contiguous().numpy()
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f" or value.dtype.itemsize not in (2, 4):
            raise TypeError(f"array {name!r} has dtype {value.dtype}; expected float32 or float16")
        return np.asarray(value, dtype="<f4", order="C")
    raise TypeError(f"{name!r} is a {type(value).__name__}, not a torch.Tensor or numpy.ndarray")


def weights_checksum(named_tensors: Mapping[str, Any]) -> int:
    """WeightsChecksum of policy/weight_update.h: the checksum a worker reports in an applied
    ``update_ack`` for the weights it now uses, when ``named_tensors`` holds exactly the model's
    parameters. A model with a tied embedding has no parameter ``lm_head.weight``: a full Hugging
    Face state dict that carries it as a copy of the embedding is accepted by push_weights, but
    hash it without that entry to get the ack's value.

    XXH3-64 (seed 0) over, for each name in byte order of its UTF-8 encoding:
    u64le(len(name_bytes)) name_bytes u64le(4 * numel) u64le(XXH3-64(float32-le data)): a hash of
    per-tensor digests, so a worker assembles it without another pass over its weights. Tensors
    are converted to float32 first (the worker stores fp32; fp16 and bf16 convert exactly), so for
    a float32 tensor the digest is its manifest checksum. Shapes are not hashed. Example:
    {"a": [1.0, 2.0], "b": [-0.5]} -> 0xcac5fea618160d40; {} -> 0x2d06800538d394c2.

    Args:
      named_tensors: {name: torch.Tensor | numpy.ndarray}, float32/float16/bfloat16.
    Raises:
      TypeError: a non-str name, or a tensor of another dtype or type.
    Cost: one float32 copy of one tensor at a time (none for contiguous fp32 CPU tensors) and
    one XXH3 pass over all bytes.
    """
    digests = []
    for name, value in named_tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor name {name!r} is not a str")
        data = _float32_le(name, value)
        digests.append((name.encode("utf-8"), data.nbytes,
                        xxhash.xxh3_64_intdigest(memoryview(data.reshape(-1).view(np.uint8)))))
    return weights_checksum_from_digests(digests)


def weights_checksum_from_digests(digests: List[Tuple[bytes, int, int]]) -> int:
    """WeightsChecksum from (UTF-8 name, 4 * numel, XXH3-64 of the float32 data) per tensor, in
    any order (sorted here). For float32 tensors the digest is ``WireTensor.checksum``, so a push
    checks the ack without hashing its weights again."""
    h = xxhash.xxh3_64()
    for name_bytes, num_bytes, digest in sorted(digests, key=lambda item: item[0]):
        h.update(struct.pack("<Q", len(name_bytes)))
        h.update(name_bytes)
        h.update(struct.pack("<QQ", num_bytes, digest))
    return h.intdigest()


def wire_digests(tensors: List[WireTensor],
                 named_tensors: Mapping[str, Any]) -> List[Tuple[bytes, int, int]]:
    """The per-tensor digests of weights_checksum for tensors already packed by to_wire:
    float32 tensors reuse their manifest checksum (no second pass over their bytes); fp16/bf16
    ones are hashed as float32 values. Combine them with weights_checksum_from_digests."""
    digests = []
    for t in tensors:
        if t.dtype == "float32":
            digests.append((t.name.encode("utf-8"), t.num_bytes, t.checksum))
        else:
            data = _float32_le(t.name, named_tensors[t.name])
            digests.append((t.name.encode("utf-8"), data.nbytes,
                            xxhash.xxh3_64_intdigest(memoryview(data.reshape(-1).view(np.uint8)))))
    return digests


def wire_weights_checksum(tensors: List[WireTensor], named_tensors: Mapping[str, Any]) -> int:
    """weights_checksum(named_tensors) for tensors already packed by to_wire (wire_digests)."""
    return weights_checksum_from_digests(wire_digests(tensors, named_tensors))
