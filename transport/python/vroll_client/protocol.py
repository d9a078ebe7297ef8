"""Message builders and codec for the vroll wire protocol, version 1 (docs/PROTOCOL.md).

Pure functions, no sockets: each ``make_*`` returns the header map of one request exactly as the
protocol names its fields, ``encode`` packs a header into frame 0 and ``decode`` unpacks a reply's
frame 0. Tensor bytes never go through here: they travel as raw frames after the header.
"""
from __future__ import annotations

import numbers
import operator
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import msgpack

PROTOCOL_VERSION = 1

#: In-flight modes of a weight update (what happens to sequences running when it applies).
UPDATE_MODES = ("drain", "abort", "restart", "continue")

#: Source dtypes a weight update may carry, by their protocol names.
WIRE_DTYPES = ("float32", "float16", "bfloat16")

#: Control requests and the reply type each one gets.
CONTROL_REPLIES = {
    "pause": "pause_ack",
    "resume": "resume_ack",
    "flush_cache": "flush_cache_ack",
    "stats": "stats",
    "health": "health",
    "shutdown": "shutdown_ack",
}


def encode(header: Mapping[str, Any]) -> bytes:
    """Packs a header map into frame 0 (msgpack; str as str, bytes as bin, ints unsigned when >= 0)."""
    return msgpack.packb(dict(header), use_bin_type=True)


def decode(frame: bytes) -> Dict[str, Any]:
    """Unpacks frame 0 of a reply. Raises ValueError when it is not a msgpack map."""
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"reply frame 0 is not msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"reply frame 0 is a msgpack {type(header).__name__}, not a map")
    return header


#: The integers a msgpack int carries: [WIRE_INT_MIN, WIRE_INT_END) (int64 and uint64).
WIRE_INT_MIN = -2 ** 63
WIRE_INT_END = 2 ** 64


def wire_int(value: Any, what: str, minimum: int = WIRE_INT_MIN) -> int:
    """``value`` as a plain int for a header field named ``what``.

    Accepts Python and numpy integers (bool is not one). Raises TypeError naming ``what`` for
    any other type, ValueError outside [minimum, 2**64) (what msgpack carries; the worker checks
    the field's own range).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} = {value!r} must be an int")
    value = int(value)
    if not minimum <= value < WIRE_INT_END:
        low = "-2**63" if minimum == WIRE_INT_MIN else str(minimum)
        raise ValueError(f"{what} = {value} must be in [{low}, 2**64)")
    return value


def wire_float(value: Any, what: str) -> float:
    """``value`` as a float for a header field named ``what``: Python or numpy ints and floats
    (bool is not a number here). Raises TypeError naming ``what`` for any other type, ValueError
    for an int too large for a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} = {value!r} must be a number")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{what} = {value} is too large for a float") from None


def _base(type_: str, id_: Optional[str]) -> Dict[str, Any]:
    header: Dict[str, Any] = {"v": PROTOCOL_VERSION, "type": type_}
    if id_ is not None:
        header["id"] = id_
    return header


def _token_ids(values: Iterable[Any], what: str) -> List[int]:
    """Plain Python ints (msgpack cannot pack numpy integers or torch scalars). TypeError names
    the bad element (bool is not a token id) or ``what`` when it is not a sequence; ValueError an
    int msgpack cannot carry. The range of the vocabulary is the worker's to check."""
    if (isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable)
            or getattr(values, "ndim", 1) != 1):
        raise TypeError(f"{what} = {values!r} must be a list of token ids")
    if hasattr(values, "tolist"):
        values = values.tolist()  # numpy / torch: plain Python ints (and bools, refused below)
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):  # numpy 1 and 2
            raise TypeError(f"{what}[{i}] = {value!r} is a bool, not a token id")
        try:
            token = operator.index(value)
        except TypeError:
            raise TypeError(f"{what}[{i}] = {value!r} is not an integer") from None
        if not WIRE_INT_MIN <= token < WIRE_INT_END:
            raise ValueError(f"{what}[{i}] = {token} is not a token id (out of the range msgpack carries)")
        out.append(token)
    return out


def make_generate(request_id: str, prompt: Sequence[int], n: int = 1,
                  sampling: Optional[Mapping[str, Any]] = None, min_policy_version: int = 0,
                  id_: Optional[str] = None) -> Dict[str, Any]:
    """The ``generate`` header. ``sampling`` is a protocol sampling map (SamplingParams.to_wire()).

    ``id`` defaults to the request id, so that every reply (accepted, sample, error) names it.
    """
    header = _base("generate", request_id if id_ is None else id_)
    header["request_id"] = request_id
    header["prompt"] = _token_ids(prompt, "prompt")
    header["n"] = int(n)
    if sampling is not None:
        header["sampling"] = dict(sampling)
    header["min_policy_version"] = int(min_policy_version)
    return header


def make_abort(request_id: str, id_: Optional[str] = None) -> Dict[str, Any]:
    """The ``abort`` header: ends the request's unfinished samples (reply ``abort_ack``)."""
    header = _base("abort", id_)
    header["request_id"] = request_id
    return header


def make_manifest_entry(name: str, dtype: str, shape: Sequence[int], num_bytes: int,
                        checksum: int) -> Dict[str, Any]:
    """One element of ``update_begin.tensors``."""
    return {"name": name, "dtype": dtype, "shape": [int(d) for d in shape],
            "num_bytes": int(num_bytes), "checksum": int(checksum)}


def make_update_begin(update_id: str, version: int, tensors: Sequence[Mapping[str, Any]],
                      mode: str = "drain", partial: bool = False,
                      id_: Optional[str] = None,
                      rope_layout: Optional[str] = None,
                      base_version: Optional[int] = None) -> Dict[str, Any]:
    """The ``update_begin`` header; ``tensors`` are make_manifest_entry maps; ``rope_layout``
    (``"interleaved"`` or ``"half_split"``), when given, is checked by the worker against its
    model's; ``base_version``, when given, is the version the update was made against: a worker
    running another one refuses it (bad_field ``base_version``)."""
    header = _base("update_begin", id_)
    header.update({"update_id": update_id, "version": int(version), "mode": mode,
                   "partial": bool(partial), "tensors": [dict(t) for t in tensors]})
    if rope_layout is not None:
        header["rope_layout"] = rope_layout
    if base_version is not None:
        header["base_version"] = int(base_version)
    return header


def make_update_chunk(update_id: str, name: str, offset: int,
                      id_: Optional[str] = None) -> Dict[str, Any]:
    """The ``update_chunk`` header; frame 1 (the bytes at ``offset``) is sent beside it, raw."""
    header = _base("update_chunk", id_)
    header.update({"update_id": update_id, "name": name, "offset": int(offset)})
    return header


def make_update_commit(update_id: str, apply: bool = True,
                       id_: Optional[str] = None) -> Dict[str, Any]:
    """The ``update_commit`` header; ``apply=False`` is phase one of a multi-worker push."""
    header = _base("update_commit", id_)
    header.update({"update_id": update_id, "apply": bool(apply)})
    return header


def make_update_apply(update_id: str, id_: Optional[str] = None) -> Dict[str, Any]:
    """The ``update_apply`` header: applies an update verified by ``update_commit(apply=False)``."""
    header = _base("update_apply", id_)
    header["update_id"] = update_id
    return header


def make_update_abort(update_id: str, id_: Optional[str] = None) -> Dict[str, Any]:
    """The ``update_abort`` header: discards the update, the worker keeps its version."""
    header = _base("update_abort", id_)
    header["update_id"] = update_id
    return header


def make_control(type_: str, id_: Optional[str] = None) -> Dict[str, Any]:
    """A control request (``pause``, ``resume``, ``flush_cache``, ``stats``, ``health``,
    ``shutdown``). Raises ValueError for any other type."""
    if type_ not in CONTROL_REPLIES:
        raise ValueError(f"unknown control request {type_!r}; one of {sorted(CONTROL_REPLIES)}")
    return _base(type_, id_)
