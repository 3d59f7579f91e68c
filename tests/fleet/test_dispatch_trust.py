"""The dispatcher around restarts: a replica back from being down keeps its bound event port and
is checked, not re-bound; a decision says whether it was made on an exact mirror of the process
that answered."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kvreuse.core import Request
from kvreuse.fleet.serving.dispatch import Dispatcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from replica import GEOMETRIES, Replica, shared_prefix

CFG = GEOMETRIES["attention"]


def bound_member() -> tuple[Dispatcher, Replica]:
    dispatcher = Dispatcher(CFG, "exact")
    member = dispatcher.add("r0", "http://127.0.0.1:1", "tcp://127.0.0.1:0", bind=True)
    replica = Replica(CFG, endpoint=member.endpoint)
    dispatcher.set_replay(
        member, "tcp://127.0.0.1:" + (replica.pub.replay_endpoint or "").rsplit(":")[-1]
    )
    return dispatcher, replica


def settle(dispatcher: Dispatcher, replica: Replica) -> None:
    member = dispatcher.members[0]
    stream = member.subscriber.stream(member.name)
    assert replica.pub.flush()
    deadline = time.monotonic() + 10
    while stream.next_seq != replica.pub.next_seq or not stream.exact:
        assert time.monotonic() < deadline
        dispatcher.refresh()
        time.sleep(0.02)


def test_a_revived_replica_keeps_its_port_and_is_checked() -> None:
    dispatcher, replica = bound_member()
    try:
        member = dispatcher.members[0]
        endpoint = member.endpoint
        for i, tokens in enumerate(shared_prefix(2)):
            replica.run(f"q{i}", tokens, decode=2)
        settle(dispatcher, replica)
        dispatcher.mark_down(member, "test")
        dispatcher.revive(member)
        assert member.up and member.endpoint == endpoint
        stream = member.subscriber.stream(member.name)
        assert stream.suspect  # not believed until checked
        dispatcher.refresh()
        assert stream.exact and stream.num_restarts == 0
        replica.run("after", shared_prefix(1)[0] + [9] * 20, decode=1)
        settle(dispatcher, replica)  # the same bound socket still receives
        tokens = shared_prefix(1)[0]
        routed = dispatcher.route(tokens, request_id="x")
        replica.mgr.add_request(Request("x", tokens))
        assert routed.predicted == replica.mgr.lookup("x").hit > 0
    finally:
        replica.close()
        dispatcher.close()


def test_an_answer_from_another_incarnation_is_not_exact() -> None:
    dispatcher, replica = bound_member()
    try:
        replica.run("q", shared_prefix(1)[0], decode=1)
        settle(dispatcher, replica)
        routed = dispatcher.route(shared_prefix(1)[0], request_id="a")
        assert routed.exact and routed.instance == replica.pub.instance_id
        assert dispatcher.confirm(routed, replica.pub.instance_id)
        assert dispatcher.confirm(routed, None)  # a replica that names none
        assert not dispatcher.confirm(routed, "another-incarnation")
        member = dispatcher.members[0]
        assert not member.subscriber.stream(member.name).exact  # checked at the next decision
    finally:
        replica.close()
        dispatcher.close()
