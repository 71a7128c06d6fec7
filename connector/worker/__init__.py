"""The connector's worker side: vLLM's worker hooks (:mod:`.hooks`,
``UcmDbWorker``), its loads into the paged KV cache (block, layer and
async), the save staging and the background writer, and preemptions. The
package imports nothing itself.
"""
