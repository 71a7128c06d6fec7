"""Hybrid models under the connector: the KV cache groups (full attention,
sliding window, SSM state), the facade over one scheduler and worker per
group (:mod:`.hooks`), their merged async loads and the SSM boundary
states. The package imports nothing itself.
"""
