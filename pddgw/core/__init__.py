"""The bottom layer: values every other package of pddgw shares.

Nothing here imports anything of pddgw above it (engines, net, pipeline,
api, sim import it, never the reverse), so a vocabulary defined here has one
definition and one validation for the whole system.
"""
