"""Deployments: what `pddgw serve` wires together (serve.py), the embedded WAN regime (regime.py), the
link secret and certificates (`pddgw keys`, keys.py).  Above api / pipeline / engines / net, below cli,
sim and bench."""
