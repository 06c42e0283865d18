"""The content digest of a worker's weights: evidence beside the version label.

A worker's *digest* is an order-independent combination of per-tensor hashes: each tensor
is hashed once as its bytes pass through a load (xxh3-64 of the raw bytes, lowercase hex,
computed by the channels), and the digest combines the ``name -> hash`` map.  Sorting by
name makes the combination independent of the order tensors arrived in, and keeps the map
mergeable: a partial update replaces some entries and the digest is simply recomputed.

Two workers (or a worker and a checkpoint manifest) hold the same weights exactly when
their digests are equal.  Pure standard library, so core stays importable anywhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Final

DIGEST_BYTES: Final = 16


def weights_digest(hashes: Mapping[str, str]) -> str:
    """Combine per-tensor hashes (``name -> lowercase hex``) into one lowercase hex digest.

    The result does not depend on the mapping's order.  Raises ``ValueError`` for a name or
    hash containing a tab or newline (they would make the encoding ambiguous).
    """
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"weightsync/1")
    for name in sorted(hashes):
        value = hashes[name]
        if any(c in s for s in (name, value) for c in "\t\n"):
            raise ValueError(f"tensor name or hash contains a tab or newline: {name!r}")
        h.update(f"{name}\t{value}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()
