"""Engine integrations of the tiered cache.

``connectors.vllm.TieredCacheConnector`` is a vLLM V1 KV connector; load it with
``kv_connector_module_path="connectors.vllm"`` (see that module's docstring).
The package imports nothing heavy, so ``import connectors`` works without vLLM.
"""
