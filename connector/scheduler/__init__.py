"""The connector's scheduler side: vLLM's scheduler hooks (:mod:`.hooks`,
``UcmDbScheduler``) and the jobs they delegate: per-request state and
controls, priced prefix lookups (local, remote, in the background), step
planning of loads and saves, and the settlement of saves planned over loads
whose outcome is not known yet. The package imports nothing itself.
"""
