"""Messages of the right shape but the wrong types, from an authenticated peer: refused at the
door, so that nothing of theirs reaches the state other clients see (metrics, dashboards)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidepool.comm.messages import TaskSpec, UpdateGraph
from tidepool.errors import CommError, ProtocolError


@pytest.mark.parametrize("raw", [
    [7, "f", None, [], {}, 0, ""],  # an integer key
    ["k", 3, None, [], {}, 0, ""],  # an integer function id
    ["k", "f", None, [], {}, 0, 9],  # an integer group
])  # fmt: skip
def test_a_task_spec_with_a_key_or_group_that_is_not_a_string_is_refused(raw: list[Any]) -> None:
    with pytest.raises(ProtocolError, match="must be strings"):
        TaskSpec.decode(raw)


def test_wanted_keys_that_are_not_strings_are_refused() -> None:
    with pytest.raises(ProtocolError, match="wanted keys must be strings"):
        UpdateGraph.decode({"op": "update-graph", "tasks": [], "wanted": [7]})


def test_an_integer_key_leaves_the_schedulers_groups_and_metrics_alone() -> None:
    """Found by a bug hunt: an update-graph with the integer key 7 was taken; its group (the key)
    went into the group statistics, and /metrics answered 500 for everyone from then on."""
    from tidepool.comm import connect
    from tidepool.dashboard.metrics import registry_for, render
    from tidepool.dashboard.model import DashboardModel
    from tidepool.scheduler.server import Scheduler

    async def main() -> tuple[set[Any], bytes]:
        sched = await Scheduler().start()
        try:
            conn = await connect(sched.address, sched.token, hello={"role": "client"})
            assert (await conn.recv())["op"] == "welcome"
            await conn.send({"op": "update-graph", "tasks": [[7, "f", None, [], {}, 0, ""]], "wanted": [7]})
            with pytest.raises(CommError):  # the connection is closed: the message was refused
                await asyncio.wait_for(conn.recv(), 10)
            good = await connect(sched.address, sched.token, hello={"role": "client"})
            assert (await good.recv())["op"] == "welcome"
            good.close()
            return set(sched.state.tasks), render(registry_for(DashboardModel(sched, lambda: None, 1.0)))
        finally:
            await sched.close()

    tasks, metrics = asyncio.run(main())
    assert 7 not in tasks
    assert b"tidepool_" in metrics


@pytest.mark.parametrize("bad", [
    {"resources": {"cpu": 1}},  # no address
    {"address": "tcp://127.0.0.1:1", "resources": "x"},
    {"address": "tcp://127.0.0.1:1", "resources": {"cpu": "lots"}},
    {"address": "tcp://127.0.0.1:1", "resources": {"cpu": float("inf")}},
])  # fmt: skip
def test_a_malformed_registration_is_refused_and_leaves_the_worker_id_free(bad: dict[str, Any]) -> None:
    """Found by a bug hunt: a register message the scheduler could not handle was answered
    'registered', the handler then failed, and the id stayed taken: the real worker of that id
    was refused for the life of the scheduler ('already registered')."""
    from tidepool.comm import connect
    from tidepool.scheduler.server import Scheduler

    async def main() -> tuple[dict[str, Any], dict[str, Any], set[str]]:
        sched = await Scheduler().start()
        try:
            first = await connect(sched.address, sched.token, hello={"role": "worker"})
            await first.send({"op": "register", "id": "w-1", **bad})
            answer = await asyncio.wait_for(first.recv(), 10)
            first.close()
            second = await connect(sched.address, sched.token, hello={"role": "worker"})
            await second.send({"op": "register", "id": "w-1", "address": "tcp://127.0.0.1:1",
                               "resources": {"cpu": 1}})  # fmt: skip
            again = await asyncio.wait_for(second.recv(), 10)
            joined = set(sched.state.workers)
            second.close()
            return answer, again, joined
        finally:
            await sched.close()

    answer, again, joined = asyncio.run(main())
    assert answer["op"] == "refused" and "malformed registration" in answer["reason"], answer
    assert again["op"] == "registered", again
    assert joined == {"w-1"}


@pytest.mark.parametrize("request_", [{"op": "retire", "id": 5}, {"op": "register-setup", "id": 5},
                                      {"op": "run", "id": 5}])  # fmt: skip
def test_a_malformed_request_is_answered_with_why(request_: dict[str, Any]) -> None:
    """Found by a bug hunt: a retire or register-setup request without its fields got no reply
    (the client waited for ever; the scheduler logged 'Task exception was never retrieved')."""
    from tidepool.comm import connect
    from tidepool.scheduler.server import Scheduler

    async def main() -> dict[str, Any]:
        sched = await Scheduler().start()
        try:
            conn = await connect(sched.address, sched.token, hello={"role": "client"})
            assert (await conn.recv())["op"] == "welcome"
            await conn.send(request_)
            reply: dict[str, Any] = await asyncio.wait_for(conn.recv(), 10)
            conn.close()
            return reply
        finally:
            await sched.close()

    reply = asyncio.run(main())
    assert reply["op"] == "reply" and reply["id"] == 5 and "KeyError" in reply["error"], reply
