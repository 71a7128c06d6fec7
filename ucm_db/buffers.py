"""The one name for the bytes-like values the store takes and returns.

``Buffer`` is what a payload, a key or a stored value may be: ``bytes``,
``bytearray`` or a ``memoryview`` (LMDB hands out views of its pages). A
leaf: it imports nothing of ucm_db.
"""

from __future__ import annotations

from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview
