"""The search: from a request and a layer table to the fastest plan that fits.

``request`` (what was asked), ``candidates`` (enumeration, pins, bounds), ``ilp`` (stage partition
and recompute, one ILP per candidate), ``solve`` (the entry point, the plan and its runners-up),
``alternatives`` (why each runner-up lost). Prices come from ``cost_models.strategy``.
"""
