"""Node roles: the one vocabulary config, the router and the workers share.

`Role` is a worker's role (it runs an engine and produces tokens and KV; a
token's `"pddgw": {"role": ...}` names one).  `NodeRole` is any node of a
deployment, a worker or the router: what `[[nodes]] role` in the config takes.
"""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["prefill", "rld", "md"]
NodeRole = Literal["router", Role]          # nested Literals flatten: ("router", "prefill", "rld", "md")

ROLES: tuple[Role, ...] = get_args(Role)
