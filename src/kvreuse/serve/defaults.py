"""The server's limits and timeouts that more than one place states (its options, the app, the
step loop, the fleet's front): each default said once, here. Imports nothing, so a command
line's parser reads them without the server's extras."""

MAX_PENDING = 256  # requests in flight before 429
MAX_BODY_BYTES = 8 * 1024 * 1024  # the largest request body (413 beyond)
STREAM_STALL_S = 30.0  # seconds a stream may wait for a client that stopped reading
DRAIN_TIMEOUT_S = 30.0  # on SIGTERM, seconds running requests get to finish
