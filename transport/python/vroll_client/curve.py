"""CURVE keys as vroll uses them (transport/curve.h): Z85 text, 40 characters per 32-byte key.
Key files hold one key on the first line that is neither blank nor a '#' comment (what
vroll-keygen writes as NAME.key and NAME.pub); see read_curve_key_file for '#', a Z85 digit."""
from __future__ import annotations

import struct
from typing import Tuple

import zmq
import zmq.utils.z85


def curve_keypair() -> Tuple[str, str]:
    """A new CURVE key pair (public, secret) as Z85 strings."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def curve_public_key(secret_key: str) -> str:
    """The Z85 public key of a Z85 secret key. Raises ValueError for a malformed key."""
    if not _is_z85_key(secret_key):
        raise ValueError(f"not a 40-character Z85 CURVE key ({len(secret_key)} characters)")
    return zmq.curve_public(secret_key.encode("ascii")).decode("ascii")


def _is_z85_key(text: str) -> bool:
    if len(text) != 40:
        return False
    try:
        zmq.utils.z85.decode(text.encode("ascii"))
    except (ValueError, KeyError, struct.error, UnicodeEncodeError):
        return False
    return True


def read_curve_key_file(path: str) -> str:
    """The key in a key file: the first whitespace-separated word of the first line that is
    neither blank nor a comment (first word starting with '#'); words after the key, such as
    "# trainer-0", are ignored.

    '#' is a Z85 digit, so it may occur inside a key (about 31% of keys hold one) and cannot
    start a comment there; but no key starts with it (the first digit of each 5-digit group is
    at most 82 of 84), so a word that starts with '#' is always a comment.
    Raises ValueError naming the file and line when the first such word is not a valid key,
    or the file holds none; OSError when it cannot be read.
    """
    with open(path, encoding="ascii") as f:
        for line_no, line in enumerate(f, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if not _is_z85_key(words[0]):
                raise ValueError(f"{path}:{line_no}: not a 40-character Z85 CURVE key")
            return words[0]
    raise ValueError(f"{path}: holds no CURVE key")


def client_keys_from_secret(secret_key: str) -> Tuple[str, str]:
    """(public, secret) for VrollClient(curve_client_keys=...) from the secret key alone."""
    return curve_public_key(secret_key), secret_key
