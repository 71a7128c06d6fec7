"""The one exception hierarchy of ucm-db.

Every error raised on purpose by ucm-db derives from :class:`UcmDbError` and
carries a ``hint``: one sentence telling the user what to change. Subclasses
also inherit the matching builtin so callers that catch ``ValueError`` or
``OSError`` keep working.
"""

from __future__ import annotations


class UcmDbError(Exception):
    """Base class of every ucm-db error.

    Attributes:
        message: what went wrong, without the hint (``str()`` joins both).
        hint: what the user can do about it (may be empty).
    """

    default_hint = ""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = self.default_hint if hint is None else hint
        text = f"{message} (hint: {self.hint})" if self.hint else message
        super().__init__(text)

    def to_dict(self) -> dict[str, str]:
        """The error as plain data to cross a process boundary
        (:func:`error_from_dict`): the nearest class of this module (a
        subclass defined elsewhere travels as the public class it is), its
        message and its hint."""
        public = next(c.__name__ for c in type(self).__mro__ if c.__module__ == __name__)
        return {"type": public, "message": self.message, "hint": self.hint}


def error_from_dict(data: object) -> UcmDbError:
    """The error :meth:`UcmDbError.to_dict` wrote; anything else (not a
    mapping, an unknown class) a plain :class:`UcmDbError` of its text."""
    if not isinstance(data, dict):
        return UcmDbError(str(data))
    kind = globals().get(str(data.get("type")))
    if not (isinstance(kind, type) and issubclass(kind, UcmDbError)):
        kind = UcmDbError
    return kind(str(data.get("message")), hint=str(data.get("hint") or ""))


class ConfigError(UcmDbError, ValueError):
    """An option or config file is invalid or conflicts with the store."""

    default_hint = "check the option names and values in the README's configuration table"


class TierError(UcmDbError, OSError):
    """A tier (local engine or remote) failed to read or write."""

    default_hint = "check that the store path is on a local, writable disk with free space"


class RemotePendingError(TierError):
    """A remote request the call did not wait for is still running (first
    contact with a slow remote); a later call takes its answer."""

    default_hint = "nothing to do: the request goes on; raise remote_deadline_s if it never answers in time"


class UploaderElsewhereError(TierError):
    """``flush`` timed out waiting for uploads that this process does not
    make: another process (or another store of the directory in this one)
    holds the store directory's uploader election, and only it uploads."""

    default_hint = ("look at the process named (its log names its remote's errors) or stop it: an uploader here takes "
                    "over within a second; the blocks stay queued meanwhile")


class EpochSupersededError(UcmDbError, RuntimeError):
    """An epoch a store took without its remote that another node's later
    invalidation, claimed on the remote, supersedes: the store moves on
    through the remote instead of telling it (ucm_db.remote.epoch_claims)."""

    default_hint = "nothing to do: the store claims a new epoch through the remote"


class StaleEpochError(UcmDbError, ValueError):
    """Keys rooted at an epoch the namespace has moved on from, given where
    only the current epoch's make sense: a pin of blocks stored before the
    namespace's epoch last moved (never served again, so never pinned;
    :mod:`ucm_db.index.pins`)."""

    default_hint = ("recompute the keys at the namespace's current epoch (ns.block_keys(tokens, epoch=store.epoch(ns))) "
                    "and pin them once they are stored; `ucm-db pin` does so when run again")


class DamagedPageError(TierError):
    """The engine met a damaged page of its file (LMDB's MDB_CORRUPTED,
    MDB_PAGE_NOTFOUND, MDB_INCOMPATIBLE ...): the store's file, not the
    machine, is at fault."""

    default_hint = "run `ucm-db verify --fix PATH`; if it cannot repair it, move the store aside (it is a cache)"


class DamagedRecordError(TierError):
    """One of the store's info records (format version, settings, creation
    record) fails its checksum or holds what no ucm-db writes: the store's
    file, not the caller's arguments, is at fault. Every door raises this
    one type for it (opening the store, the maintenance readers, the CLI:
    exit status 1)."""

    default_hint = "run `ucm-db verify PATH`; if it cannot repair it, move the store aside (it is a cache and starts empty)"


class StoreFullError(TierError):
    """The batch cannot fit even after evicting everything evictable."""

    default_hint = "raise capacity_bytes or put smaller batches"


class LockedError(TierError):
    """Another process holds the store in a way that excludes this one."""

    default_hint = "stop the other process, or use the LMDB engine, which several processes can share"


class CorruptBlockError(UcmDbError, ValueError):
    """A stored block failed validation (header, length, key or checksum).

    Reads never raise it: the store turns a corrupt block into a miss and a
    quarantine record, so callers never see wrong bytes.
    :meth:`ucm_db.Store.put_encoded` raises it for a blob that does not
    verify under its key (nothing is written).
    """

    default_hint = "the block is quarantined and will be recomputed; run `ucm-db verify PATH` to check the rest"


class MissingAncestorError(UcmDbError, KeyError):
    """A put would store a block whose parent block is not stored.

    The store keeps the prefix invariant: every stored block's ancestors are
    stored too. A put of a chain suffix must name the parent key, and that
    parent must be present (or be in the same batch).
    """

    default_hint = "put the chain from its first missing block, passing parent= the key before it"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class FormatVersionError(UcmDbError, RuntimeError):
    """The store was written by another on-disk format version."""

    default_hint = "run `ucm-db migrate PATH`"


class MigrationError(UcmDbError, RuntimeError):
    """A migration failed; the store is left at its previous version."""

    default_hint = "restore from backup or report the error; the store was not changed"


class ClosedError(UcmDbError, RuntimeError):
    """The store was used after close()."""

    default_hint = "open the store again with ucm_db.open(path)"


class CommitProcessError(UcmDbError, RuntimeError):
    """The commit process (:mod:`ucm_db.committer`) could not start, is
    gone, or was not sent a request (over the wire's limit: it lives on).

    Attributes:
        request_sent: False where no request of this error ever reached the
            child whole, so it committed none (:mod:`ucm_db.committer`).
    """

    default_hint = "commit in this process instead (the connector does so by itself and logs it); see the log for the cause"
    request_sent = True
