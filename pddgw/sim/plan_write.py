"""The planner's winners as files: a `pddgw serve` config.toml and scenario `[[deployments]]` blocks.

`serve_config` turns a candidate into the `Config` its processes run: the
nodes `pddgw sim` expands from the candidate's groups (same names, engines,
costs, relay flags), each on 127.0.0.1 with a port of its own, node links authenticated
and over mutual TLS with the files `pddgw keys` writes, the scenario's links
at the plan's WAN.  `config_toml` writes any `Config` as TOML that
`pddgw.config.load_config` reads back equal: the fields that differ from
their defaults (required ones always), nested sections as tables, node lists
as arrays of tables.  `deployments_toml` writes `[[deployments]]` blocks in
the scenario format (`scenarios/paper.toml`'s style: node groups as inline
tables).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from pddgw.config import Config, CostModelConfig, ModelConfig, NetConfig, NodeConfig, ServerConfig, TlsConfig
from pddgw.sim.plan_space import Candidate, Plan
from pddgw.sim.scenario import DeploymentSpec, deployment_config

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
FIRST_PORT = 9101
# Keys a reader of the file looks for, written even at their defaults.
ALWAYS: dict[type, tuple[str, ...]] = {
    NodeConfig: ("name", "role", "cluster", "host"),
    CostModelConfig: ("hardware", "tensor_parallel", "data_parallel", "expert_parallel"),
}


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()) + " }"
    if dataclasses.is_dataclass(v):
        return _value(_changed(v))
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _changed(obj: Any) -> dict[str, Any]:
    """The fields of a dataclass that differ from their defaults (required ones always), in order."""
    always = ALWAYS.get(type(obj), ())
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if f.init and getattr(obj, f.name) is not None
            and (f.name in always or getattr(obj, f.name) != _default(f))}


def _table_list(v: Any) -> bool:
    return isinstance(v, tuple) and bool(v) and all(dataclasses.is_dataclass(x) for x in v)


def _emit(obj: Any, path: str, lines: list[str], header: str = "") -> None:
    fields = _changed(obj)
    # An optional section (default None) that is present needs its header even when empty.
    optional = {f.name for f in dataclasses.fields(obj) if f.default is None}
    scalars = {k: v for k, v in fields.items() if not dataclasses.is_dataclass(v) and not _table_list(v)}
    if header or (path and scalars):
        lines += ["", header or f"[{path}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars.items()]
    for k, v in fields.items():
        sub = f"{path}.{_key(k)}" if path else _key(k)
        if dataclasses.is_dataclass(v):
            _emit(v, sub, lines, header=f"[{sub}]" if k in optional else "")
        elif _table_list(v):
            for item in v:
                _emit(item, sub, lines, header=f"[[{sub}]]")


def config_toml(cfg: Config, comment: str = "") -> str:
    """TOML that `load_config` reads back as `cfg` (module docstring)."""
    lines = [f"# {line}" if line else "#" for line in comment.splitlines()]
    _emit(cfg, "", lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def serve_config(plan: Plan, cand: Candidate) -> Config:
    """The `pddgw serve` deployment of a candidate (module docstring)."""
    sc = plan.scenario
    sim = deployment_config(sc, cand.deployment(plan.spec), plan.wan_gbps)
    nodes = []
    for i, n in enumerate(sim.nodes):
        port = 0 if n.role == "router" else FIRST_PORT + i - 1
        nodes.append(NodeConfig(n.name, n.role, n.cluster, host="127.0.0.1", port=port, cost=n.cost, engine=n.engine,
                                relay=n.relay))
    tls = TlsConfig(enabled=True, cert_file="keys/{node}.crt", key_file="keys/{node}.key", ca_file="keys/ca.crt",
                    mutual=True)
    net = NetConfig(secret_file="keys/link-secret", stripes=2, links=sim.net.links, tls=tls)
    return Config(model=ModelConfig(profile=sc.model), engine=sim.engine, net=net, policy=sim.policy,
                  server=ServerConfig(host="127.0.0.1", port=8000, api_keys=("change-me-client-key",)),
                  nodes=tuple(nodes))


def serve_comment(plan: Plan, cand: Candidate, goodput_rps: float | None, filename: str = "config.toml") -> str:
    gp = "not evaluated" if goodput_rps is None else f"{goodput_rps:.4g} req/s within SLO"
    return (f"Written by `pddgw plan` ({plan.spec.name}): the {cand.kind} winner,\n"
            f"  {cand.label()}\n"
            f"  {cand.gpus} GPUs, ${cand.price:.2f}/h, SLA goodput {gp} on scenario {plan.scenario.name}.\n"
            "Every node runs the cost-model engine (model.profile); once, from this directory:\n"
            f"    pddgw keys keys --config {filename}\n"
            "then one process per node, the router last (or all of them in one: --role all):\n"
            f"    pddgw serve --config {filename} --role ROLE --node NAME")


def deployments_toml(plan: Plan, winners: list[tuple[Candidate, float | None]]) -> str:
    """`[[deployments]]` blocks of the winners, named by their kind, for a scenario to include."""
    lines = [f"# Written by `pddgw plan` ({plan.spec.name}): each kind's winner, ranked by SLA goodput per "
             "USD per hour."]
    for cand, goodput in winners:
        dep: DeploymentSpec = cand.deployment(plan.spec)
        gp = "not evaluated" if goodput is None else f"{goodput:.4g} req/s"
        lines += ["", f"# {cand.label()}: {cand.gpus} GPUs, ${cand.price:.2f}/h, SLA goodput {gp}",
                  "[[deployments]]", f"name = {_value(dep.name)}"]
        policy = _changed(dep.policy)
        if policy:
            lines.append(f"policy = {_value(policy)}")
        lines.append("nodes = [")
        for g in dep.nodes:
            # The keys a reader looks for first, always; then whatever else differs from the defaults.
            head = {k: getattr(g, k) for k in ("role", "count", "cluster", "hardware", "tensor_parallel",
                                                "data_parallel")}
            lines.append(f"  {_value({**head, **_changed(g)})},")
        lines.append("]")
    return "\n".join(lines) + "\n"
