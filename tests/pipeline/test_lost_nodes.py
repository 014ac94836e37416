"""A node a request lost (pipeline/placement.py): skipped until its link reconnects, then taken again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pddgw.config import Config, NodeConfig
from pddgw.core.roles import Role
from pddgw.core.sampling import SamplingParams
from pddgw.net.link import LinkState, LinkStats
from pddgw.pipeline.estimator import LinkEstimator
from pddgw.pipeline.flight import Flight
from pddgw.pipeline.ordering import StreamMerger
from pddgw.pipeline.placement import NodeHandle, Placement
from pddgw.pipeline.state import RequestTracker


@dataclass
class _Link:
    """What placement reads of a link: its state and its reconnect count."""

    state: LinkState = LinkState.OPEN
    stats: LinkStats = field(default_factory=LinkStats)

    def restart(self) -> None:
        self.state, self.stats.reconnects = LinkState.OPEN, self.stats.reconnects + 1


async def _emit(_: object) -> None:
    return None


def _setup() -> tuple[Placement, Flight, dict[str, _Link]]:
    cfg = Config()
    links = {"p0": _Link(), "md0": _Link()}
    nodes = {name: NodeHandle(NodeConfig(name, role), links[name], 16, 8)  # type: ignore[arg-type]
             for name, role in (("p0", Role.PREFILL), ("md0", Role.MD))}
    place = Placement(cfg, nodes, 64, LinkEstimator.from_config(cfg.policy))
    fl = Flight("r1", (1, 2, 3), SamplingParams(), RequestTracker("r1"), StreamMerger("r1"), _emit)
    return place, fl, links


def test_a_lost_node_is_skipped_until_its_link_reconnects():
    place, fl, links = _setup()
    md = place.nodes["md0"]
    fl.exclude(md)
    assert fl.excludes(md) and place.pick(Role.MD, fl) is None
    links["md0"].state = LinkState.RECONNECTING
    assert fl.excludes(md) and place.pick(Role.MD, fl) is None
    links["md0"].restart()                       # the restarted process
    assert not fl.excludes(md) and place.pick(Role.MD, fl) is md
    fl.exclude(md)                               # lost again: its new incarnation is skipped
    assert place.pick(Role.MD, fl) is None


async def test_await_node_waits_for_a_lost_node_to_come_back():
    place, fl, links = _setup()
    md = place.nodes["md0"]
    fl.exclude(md)
    links["md0"].state = LinkState.RECONNECTING
    # Not back within wait_s: no node.
    assert await place.await_node(fl, (Role.MD, Role.RLD), 0.0) is False
    waiting = asyncio.create_task(place.await_node(fl, (Role.MD, Role.RLD), 600.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    links["md0"].restart()
    assert await waiting is True
    assert place.pick(Role.MD, fl) is md
    # A role with no node at all is not waited for.
    assert await place.await_node(fl, (Role.RLD,), 600.0) is False
