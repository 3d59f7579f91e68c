"""What the Ray ingress and the request router share in one process (the ingress replica's).

Ray ships the router's class with its module by value, so state they both read lives here, in a
module both import by reference: the names a replica announces its sockets under, and the
router's last predictions, which the ingress reports in `x-kvreuse-predicted-cached-tokens`.
Needs no Ray."""

from __future__ import annotations

import threading
from collections import OrderedDict

EVENTS_KEY = "kvreuse_events"  # what a replica announces in its metadata
REPLAY_KEY = "kvreuse_replay"
_MAX_PREDICTIONS = 10_000  # requests whose prediction the ingress has not read yet
_predictions: OrderedDict[str, dict[str, int]] = OrderedDict()
_lock = threading.Lock()


def remember_prediction(rid: str, per_replica: dict[str, int]) -> None:
    """The router's prediction for request `rid`, per replica id (the router's thread)."""
    with _lock:
        _predictions[rid] = per_replica
        while len(_predictions) > _MAX_PREDICTIONS:
            _predictions.popitem(last=False)


def take_prediction(rid: str) -> dict[str, int] | None:
    """The prediction for `rid` (None when the policy made none), forgotten once read."""
    with _lock:
        return _predictions.pop(rid, None)
