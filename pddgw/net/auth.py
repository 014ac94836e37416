"""Challenge/response authentication with the shared deployment secret.

The secret never crosses the wire.  Handshake on every new connection (the
client speaks first, so neither side reads a frame meant for the other's
HTTP layer):

1. client -> server  `Hello(node, link_id, stripe, stripes, nonce_c, shaping)`
2. server -> client  `Challenge(node, nonce_s, proof_s)`,
   proof_s = HMAC(secret, "s" | everything above | nonce_s)
3. client -> server  `Auth(proof_c)`, proof_c = HMAC(secret, "c" | same fields)
4. server -> client  `Welcome()`: the link is open.

Both sides prove knowledge of the secret (mutual), fresh nonces on both sides
stop replays, the side tag stops reflecting one proof as the other, and the
fields are length-prefixed so no two field lists hash alike.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from pddgw.messages import Hello

_DOMAIN = b"pddgw-link-auth-v1"


def new_nonce() -> str:
    return secrets.token_hex(32)


def _proof(secret: str, side: bytes, hello: Hello, server_node: str, server_nonce: str) -> str:
    mac = hmac.new(secret.encode(), digestmod=hashlib.sha256)
    parts = (_DOMAIN, side, hello.node.encode(), hello.link_id.encode(), str(hello.stripe).encode(),
             str(hello.stripes).encode(), hello.nonce.encode(), hello.shaping.encode(),
             server_node.encode(), server_nonce.encode())
    for p in parts:
        mac.update(struct.pack("<I", len(p)))
        mac.update(p)
    return mac.hexdigest()


def server_proof(secret: str, hello: Hello, server_node: str, server_nonce: str) -> str:
    return _proof(secret, b"s", hello, server_node, server_nonce)


def client_proof(secret: str, hello: Hello, server_node: str, server_nonce: str) -> str:
    return _proof(secret, b"c", hello, server_node, server_nonce)


def verify(expected: str, got: str) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected.encode(), got.encode())
