"""The cluster secret, and the CurveZMQ keys every node derives from it.

Every socket between hosts (node_link/) is CurveZMQ: encrypted, and authenticated both ways. No key is ever
sent or stored: each node derives the same two key pairs from the shared secret (--cluster-secret-file FILE,
or $CLEARSERVE_CLUSTER_SECRET), one for the frontend node's server socket and one every headless node
presents as a client. A node with another secret derives other keys: its handshake fails and it is refused
(the frontend node logs it); one without a secret cannot start cross-host data parallelism at all.

    secret ──PBKDF2-SHA256(salt "clearserve-curve-server")──▶ 32 bytes ──Z85──▶ server secret key ─▶ public key
           ──PBKDF2-SHA256(salt "clearserve-curve-node")────▶ 32 bytes ──Z85──▶ node secret key   ─▶ public key
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

SECRET_ENV = "CLEARSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16  # `openssl rand -hex 32` gives 64; a short word is not a secret
# The secret is meant to be random, so the KDF need not be slow; PBKDF2's rounds still make a guessed short
# secret expensive to try. ~0.1 s per key pair, twice per node start.
KDF_ROUNDS = 100_000


class ClusterSecretError(ValueError):
    """No secret, an unreadable file, or one too short: the node must not start across hosts."""


def read_cluster_secret(path: str | None) -> bytes:
    """The secret from `path` (surrounding whitespace stripped: a trailing newline is not part of it), else from
    $CLEARSERVE_CLUSTER_SECRET."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ClusterSecretError(f"--cluster-secret-file {path}: {exc.strerror}") from None
        where = f"--cluster-secret-file {path}"
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
        where = f"${SECRET_ENV}"
        if not secret:
            raise ClusterSecretError(
                f"data parallelism across hosts needs a shared secret: --cluster-secret-file FILE or ${SECRET_ENV} "
                "(the same on every node; e.g. `openssl rand -hex 32 > FILE`)"
            )
    if len(secret) < MIN_SECRET_BYTES:
        raise ClusterSecretError(f"{where}: the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85-encoded CurveZMQ keys (40 characters each), as pyzmq's curve_* socket options take them."""

    server_public: bytes
    server_secret: bytes
    node_public: bytes
    node_secret: bytes


def derive_curve_keys(secret: bytes) -> CurveKeys:
    import zmq
    from zmq.utils import z85

    def pair(purpose: bytes) -> tuple[bytes, bytes]:
        raw = hashlib.pbkdf2_hmac("sha256", secret, b"clearserve-curve-" + purpose, KDF_ROUNDS, 32)
        secret_key = z85.encode(raw)  # Curve25519 clamps any 32 bytes into a valid secret key
        return zmq.curve_public(secret_key), secret_key

    server_public, server_secret = pair(b"server")
    node_public, node_secret = pair(b"node")
    return CurveKeys(server_public, server_secret, node_public, node_secret)
