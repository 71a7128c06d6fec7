"""The ``ucm-db`` command line (:mod:`ucm_db.tools.cli`, one module per
command) over the public API and :mod:`ucm_db.maintenance`; the benchmarks
(:mod:`ucm_db.tools.bench`) and the demo live beside it and are loaded only
when asked for."""
