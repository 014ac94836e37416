"""Cluster-scale simulation: cost-model profiles, virtual-clock runs, scenarios and reports."""
