"""Publishers that prove who they are: ZeroMQ's CURVE on the event and replay sockets.

A publisher given a secret key makes its PUB and ROUTER sockets CURVE servers; a subscriber
given that publisher's public key dials both as a CURVE client (with a key pair of its own,
made per subscriber). Whichever side binds, nobody without the replica's secret key can then
complete a handshake with the subscriber's sockets, so nothing forged on the stream's port is
ever read, and the traffic is encrypted. Who may *read* a stream is not restricted (a CURVE
server without ZeroMQ's authentication handler accepts any client that knows its public key):
keep event ports on loopback or a private network, as the token ids they carry ask.

Keys are ZeroMQ's Z85 text, 40 characters: `generate()` makes a pair, `public_of(secret)` derives
the public half, and `read_key(text_or_path)` accepts either the key itself or a certificate
file written by `zmq.auth.create_certificates` (its `secret-key` or `public-key` line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import zmq

KEY_LENGTH = 40
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


@dataclass(frozen=True)
class KeyPair:
    public: str
    secret: str


def generate() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public.decode("ascii"), secret.decode("ascii"))


def public_of(secret: str) -> str:
    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


def read_key(text: str, which: str = "secret-key") -> str:
    """A Z85 key given as itself or as a ZeroMQ certificate file (its `which` line); ValueError
    saying what is wrong otherwise."""
    if _Z85.match(text):
        return text
    path = Path(text)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{text!r} is neither a {KEY_LENGTH}-character Z85 key nor a "
            f"readable certificate file ({exc})"
        ) from None
    for line in lines:
        name, _, value = line.strip().partition("=")
        if name.strip() == which:
            key = value.strip().strip('"')
            if _Z85.match(key):
                return key
    raise ValueError(f"{text}: no {which} of {KEY_LENGTH} Z85 characters in the file")


def serve(sock: zmq.Socket[bytes], secret: str) -> None:
    """Make `sock` a CURVE server with `secret` (before it binds or connects)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public_of(secret).encode("ascii"))


def dial(sock: zmq.Socket[bytes], server_public: str, own: KeyPair) -> None:
    """Make `sock` a CURVE client of the server whose public key is `server_public`."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, own.public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, own.secret.encode("ascii"))
