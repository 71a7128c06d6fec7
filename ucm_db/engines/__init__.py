"""Engines: transactional tables on a medium, below the block index.

* :mod:`ucm_db.engines.base` -- the block-level :class:`Tier` and the
  transactional :class:`Engine` interfaces, and the ``Buffer`` alias.
* :mod:`ucm_db.engines.lmdb` (the default), :mod:`ucm_db.engines.rocksdb`
  and :mod:`ucm_db.engines.memory` (the reference and test oracle);
  :mod:`ucm_db.engines.gate`, the shared/exclusive gate they share.

Engines are built in one place, :func:`ucm_db.format.open_engine`. The
package imports nothing itself, so loading one engine loads no other. The
block index over an engine is :mod:`ucm_db.index`; the remote tier is
:mod:`ucm_db.remote`.
"""
