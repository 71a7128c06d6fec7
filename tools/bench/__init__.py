"""ucm-db's benchmarks and the demo's engine jobs: measuring code, apart from the product.

One module per benchmark, each with a click ``command`` that ``ucm-db bench
NAME`` runs (:mod:`ucm_db.tools.cli_bench` imports a module only when its
command is used; ``python -m ucm_db.tools.bench NAME`` is the same group):

* :mod:`.core` -- the store against same-run baselines (put, get, codec,
  lookup, keys, scale), with :mod:`.common`, :mod:`.put`, :mod:`.read`,
  :mod:`.index` and real K/V activations from :mod:`.kv_sample`;
* :mod:`.engines` -- LMDB against RocksDB;
* :mod:`.remote` -- the remote tier against raw fsspec (:mod:`.down_remote`
  simulates a remote that is down);
* :mod:`.ttft` and :mod:`.overhead` -- real vLLM engines on CPU, each in its
  own process (:mod:`.engine_process`, :mod:`.engine_pass`);
* and more, each named in :data:`ucm_db.tools.cli_bench.BENCHMARKS` (which
  the layout test checks): TP units, the remote codec, ...

Invariants:
    * Nothing in ``ucm_db``'s core, the connector or the CLI's start-up
      imports this package (tests/test_bench_layout.py).
    * Benchmarks print figures; they assert only what makes a figure
      meaningless if false (e.g. a hit that should be a miss).
"""
