"""The identifiers P, D and the proxy share for one request: transfer ids and prompt digests.

A *transfer id* is the proxy's random capability shared by both legs of one request (early registration:
D names P's request by it before P has answered); a *prompt digest* lets P refuse a registration whose
prompt differs from its own. Both are plain values with no msgspec or state, checked wherever they arrive
(the proxy's ``kv_transfer_params``, a registration), so they live apart from the side-channel structs of
:mod:`.messages`, which bounds its fields by them.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["DIGEST_CHARS", "TRANSFER_ID_CHARS", "TRANSFER_REF_PREFIX", "check_transfer_id", "prompt_digest"]

#: Hex characters of a :func:`prompt_digest`
DIGEST_CHARS = 32
#: ``ReqRef.p_req`` of an early registration: this prefix and the proxy's transfer id (P's own request id is
#: not known to D before P finishes)
TRANSFER_REF_PREFIX = "transfer:"
#: Bounds of a transfer id (the proxy's random capability shared by both legs of one request)
TRANSFER_ID_CHARS = (16, 96)
_TRANSFER_ID_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def check_transfer_id(value: object) -> str:
    """``value`` when it is a usable transfer id (a string of 16..96 letters, digits, ``_`` or ``-``: the
    proxy makes it random, and it is the capability both legs share); ``ValueError`` naming the problem."""
    lo, hi = TRANSFER_ID_CHARS
    if not isinstance(value, str):
        raise ValueError(f"transfer_id must be a string, got {type(value).__name__}")
    if not lo <= len(value) <= hi or not set(value) <= _TRANSFER_ID_ALPHABET:
        raise ValueError(f"transfer_id must be {lo}..{hi} characters of [A-Za-z0-9_-], got {len(value)} "
                         f"characters{'' if set(value) <= _TRANSFER_ID_ALPHABET else ' with others'}")
    return value


def prompt_digest(token_ids: object) -> str:
    """A 128-bit digest of a prompt's token ids (``""`` for none): P and D compare theirs, so KV computed for
    one prompt never feeds another of the same length."""
    if token_ids is None:
        return ""
    ids = array("q", token_ids)  # type: ignore[call-overload]
    if not ids:
        return ""
    return hashlib.blake2b(ids.tobytes(), digest_size=DIGEST_CHARS // 2).hexdigest()
