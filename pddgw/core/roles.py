"""Node roles and pipelines: the one vocabulary config, router, workers, logs and metrics share.

Both are StrEnums: a member equals its value (`Role.PREFILL == "prefill"`), which is
how config files, JSON answers, log lines and metric labels spell it.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """A node's role in a deployment (`[[nodes]] role`); a token's `"pddgw": {"role": ...}`
    names the worker that produced it."""

    ROUTER = "router"
    PREFILL = "prefill"
    RLD = "rld"
    MD = "md"


# The workers: they run an engine and produce tokens and KV.
ROLES: tuple[Role, ...] = (Role.PREFILL, Role.RLD, Role.MD)


class Pipeline(StrEnum):
    """The path a request takes across the clusters (docs/architecture.md, Pipelines)."""

    P_MD = "P-MD"
    P_RLD_MD = "P-RLD-MD"
    P_RLD = "P-RLD"


PIPELINES: tuple[Pipeline, ...] = tuple(Pipeline)
