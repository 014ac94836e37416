"""pddgw: cross-datacenter LLM serving (Prefill -> Relay-Decode -> Main-Decode)."""

__version__ = "0.1.0"
