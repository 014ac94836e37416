"""Real deployments on loopback, for the tests and the benchmarks that start processes.

One piece per concern: `ports` (a free TCP port), `proxy` (the TCP fault
proxy between the clusters: cut, slow, heal, byte counts), `cluster` (the
config.toml of a loopback router / P / RLD / MD deployment), `launch`
(`python -m pddgw ...` processes: spawn, wait ready, kill, restart, stop by
pid, logs), `leaks` (what a quiet deployment's /debug/state must show, and
waiting until it does) and `reference` (the single-node generation every
path must reproduce).

Where it sits: above config, engines, net and pipeline (it starts them as
processes or reads what they serve), beside sim, below bench; tests and
benchmarks import it, nothing in the serving code does.
"""
