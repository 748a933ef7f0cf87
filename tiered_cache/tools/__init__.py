"""Operator and developer tools around the core: the P/D demo, launchers for vLLM and
LMCache servers, and the synthetic trace generator. They may start processes, touch files
and import adapters; the core (``tiered_cache``'s other modules, ``policies``) does not
depend on them."""
