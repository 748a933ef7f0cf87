"""``tiered-cache plan``: is P/D worth it for this model, these links and this traffic?

The router's cost model (``tiered_cache.split``) and the production store and policies,
run offline over a workload: ``model`` (KV bytes per token from a ``config.json``),
``hardware`` (engines per server size, from a calibration run or a roofline; links;
capacities; presets), ``workloads`` (the serving bench's, or a Mooncake trace), ``sim``
(the replay), ``planner`` (deployments, figures, the verdict), ``calibrate``.
"""
