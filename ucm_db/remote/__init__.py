"""The remote wing: everything a store does with its remote tier.

Between the :class:`~ucm_db.store.Store` and the tiers (the fsspec tier and
its object format stay in :mod:`ucm_db.remote.tier`):

* :mod:`.wing` -- :class:`~ucm_db.remote.wing.RemoteWing`, what the store
  holds and calls.
* :mod:`.link` -- the link: pool, breaker, deadlines, fetches and streams.
* :mod:`.search` -- the breaker and the parallel prefix search.
* :mod:`.promotion` -- the one way fetched blocks enter the local tier.
* :mod:`.warming` -- pulling chains in ahead of traffic (the tier and the
  link, never the store).
* :mod:`.uploader` -- draining the upload queue; :mod:`.codec_choice` --
  the remote objects' codec.
* :mod:`.inline_reads` -- reads on the caller's thread for a fast local disk.
* :mod:`.gc` -- garbage collection of a remote tier.

This package imports nothing at import time: import the module you need.
"""
