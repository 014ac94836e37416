"""Real deployments on loopback and engines in process, for the tests and the benchmarks.

One piece per concern: `ports` (a free TCP port), `proxy` (the TCP fault
proxy between the clusters: cut, slow, heal, byte counts), `cluster` (the
config.toml of a loopback router / P / RLD / MD deployment), `launch`
(`python -m pddgw ...` processes: spawn, wait ready, kill, restart, stop by
pid, logs), `deployment` (those processes and the WAN proxy on an event
loop, with their RSS, and a fault schedule applied to them), `client`
(one response over /v1/responses, closed-loop conversation load, and a
whole load run with its faults and checks: `run_load`),
`replay` (a simulator workload played in real time), `leaks` (what a quiet
deployment's /debug/state must show, and waiting until it does),
`reference` (the single-node generation every path must reproduce), `peer`
(a benchmark's peer process and the raw TCP ceiling), `engines` (engines
driven in process), `invariance` (one batch's output and logits down each
engine path) and `sides` (the engine benchmark's cases timed on pddgw,
transformers and vLLM: their start-up and interleaved timing).

Where it sits: above config, engines, net and pipeline (it starts them as
processes, drives them in process or reads what they serve) and above sim
(`replay` plays its workloads), below bench; tests and benchmarks import it,
nothing in the serving code does.
"""
