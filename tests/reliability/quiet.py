"""The end of every reliability test: nothing left in use anywhere (pddgw.harness.leaks).

`state` is the router's `/debug/state` document (RouterSide.state): the
router's own in-flight counters and every node's pool and in-flight entries.
`wait_quiescent` polls until everything is zero, then the caller holds an
exact document.
"""

from pddgw.harness.leaks import wait_quiescent

__all__ = ["wait_quiescent"]
