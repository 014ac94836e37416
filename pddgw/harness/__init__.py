"""Real deployments on loopback and engines in process, for the tests and the benchmarks.

One module per concern: ports, proxy (the WAN fault proxy), cluster (a loopback deployment's
config.toml), launch (processes), deployment (processes + proxy + fault schedule), client
(load over /v1/responses), replay (a simulator workload in real time), leaks, reference
(single-node generation), peer, engines, invariance, sides (the engine benchmark's sides).
Above config, engines, net, pipeline and sim, below bench; nothing in the serving code
imports it.
"""
