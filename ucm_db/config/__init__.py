"""Store configuration: one frozen dataclass and one parser used by every door.

Invariants:
    * Every field is validated in ``__post_init__``; an invalid value raises
      :class:`~ucm_db.errors.ConfigError` naming the field and the fix.
    * ``from_dict`` rejects unknown keys, listing the valid ones.
    * Fields in :data:`PERSISTED_FIELDS` are written into a store when it is
      created; reopening uses them, and an explicit conflicting value is an
      error (a store's codec or capacity never changes by accident).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_db.codec import MAX_RAW_BYTES
from ucm_db.errors import ConfigError

#: The largest ``remote_max_object_bytes``: the codec's largest raw block
#: plus room for its heads (an object over the remote format's own bound is
#: refused as corrupt whatever this setting says).
MAX_REMOTE_OBJECT_BYTES = MAX_RAW_BYTES + (1 << 20)

CODECS = ("zstd", "none")
DURABILITIES = ("sync", "group")
ENGINES = ("lmdb", "rocksdb", "memory")
REMOTE_MODES = ("write_back", "write_through")
#: Codec of remote objects: as the local tier, fixed, or chosen from measured speeds.
REMOTE_CODECS = ("same", "none", "zstd", "auto")
#: What an open checks before LMDB maps the store: every branch and leaf page (in a child process), or nothing.
OPEN_CHECKS = ("pages", "none")

#: Settings recorded in the store at creation and enforced on reopen.
PERSISTED_FIELDS = ("capacity_bytes", "codec", "zstd_level", "durability", "engine")

GIB = 1 << 30
MIB = 1 << 20
#: Longest background sync / activity-flush interval: group durability's
#: promise ("a power loss may lose the last interval") needs a real bound.
MAX_SYNC_INTERVAL_S = 3600.0
#: Shortest background interval: below it the maintenance thread would spin
#: a core on syncs and activity flushes (issue 26: 1e-9 did).
MIN_SYNC_INTERVAL_S = 0.001
#: Longest wait on the remote tier per lookup.
MAX_REMOTE_DEADLINE_S = 3600.0
#: Largest capacity of any engine (sizes are 64-bit counters; 2**63 overflowed them).
MAX_CAPACITY_BYTES = 1 << 62
#: Largest LMDB map: LMDB maps its whole file into the process, and a 64-bit
#: Linux process addresses 128 TiB (47 bits); ucm-db keeps to half of it
#: (the map also grows to at most this, see ``ucm_db.engines.lmdb``).
MAX_LMDB_MAP_BYTES = 1 << 46
#: Largest LMDB capacity: a new store's map is 2 x capacity + 256 MiB.
MAX_LMDB_CAPACITY_BYTES = (MAX_LMDB_MAP_BYTES - (256 << 20)) // 2
#: Most LMDB reader slots: each takes 64 bytes of the lock file (65536: 4 MiB;
#: 10**9 made a 64 GB sparse lock file).
MAX_READERS = 1 << 16


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Options of :func:`ucm_db.open`, by field name.

    Attributes:
        capacity_bytes: stored (compressed) payload bytes kept before LRU
            eviction starts.
        codec: ``"zstd"`` (byte-shuffled zstd, for 2-byte KV dtypes) or
            ``"none"``.
        zstd_level: zstd level for the ``zstd`` codec.
        durability: ``"sync"`` fsyncs every commit; ``"group"`` syncs every
            ``sync_interval_s`` (a killed process loses nothing it
            committed; a power loss may lose the last interval).
        sync_interval_s: interval of the background sync and of flushing
            access-time and hit counters.
        sync_bytes: with ``"group"``, the background sync also starts as
            soon as this many stored bytes were committed since the last
            one, so the disk writes back while puts go on and ``flush()``
            finds little left to wait for.
        engine: local engine: ``"lmdb"`` (multi-process), ``"rocksdb"``
            (single process) or ``"memory"`` (reference, not persistent).
        encode_threads: the store's codec threads: they compress a batch
            before its commit and decode zstd blocks of 512 KiB frames or
            more (a read's batch, a read-through's fetched blocks); 0 does
            all of it in the caller's thread.
        max_readers: LMDB reader slots (processes x threads reading at once).
        map_size_bytes: initial LMDB map size; None derives it from capacity.
        remote: fsspec URL of the remote tier (``s3://b/p``, ``file:///d``,
            ``memory://x``) or None.
        remote_options: keyword arguments for the fsspec filesystem
            (endpoint, credentials, timeouts). Never persisted.
        remote_mode: ``"write_back"`` (durable upload queue drained in the
            background) or ``"write_through"`` (put uploads before it
            returns).
        remote_deadline_s: longest a lookup waits on the remote tier.
        upload_concurrency: parallel uploads of the background uploader.
        remote_read_concurrency: parallel requests of remote reads (the
            lookups' probes and fetches, read-through of ``get``). A lookup
            of N objects takes about N / this many round trips: raise it
            for an object store with long round trips (64 against 20 ms:
            BENCHMARKS.md); on a fast shared directory more threads only
            contend for the CPU.
        remote_max_object_bytes: the largest remote object this store
            reads, and the largest block one may declare it decodes to (a
            larger one is a miss, never read into memory nor decoded): it
            bounds what one hostile object can cost a reader, about twice
            this per concurrent read. Raise it only for KV blocks over
            256 MiB.
        remote_lookup_max_bytes: the most bytes of remote objects one
            lookup holds (and one read-through ``get``, warm or background
            promotion holds fetched ahead of what it has taken in); objects past it
            are left to the background promotion (a lookup) or fetched as
            room frees (a stream). At least ``remote_max_object_bytes``. A
            request in flight also holds its first read (at most 8 MiB).
            None (the default): 512 MiB, or ``remote_max_object_bytes``
            when that is larger.
        remote_codec: codec of remote objects: ``"same"`` as ``codec``,
            ``"none"``, ``"zstd"``, or ``"auto"`` (zstd when the measured
            link is slower than the measured compression; see
            :mod:`ucm_db.remote.codec_choice`). Read-through keeps what it fetched.
        remote_auth_key_file: path of a key file (:mod:`ucm_db.auth`: hex
            keys, one per line, the first signs, all verify, in order):
            uploads are signed and a remote object is served only if one
            of the keys signed it (others are misses). Never the key
            itself. A file everyone may read is refused.
        remote_auth_key_env: name of an environment variable holding the
            keys in the same form (after the file's, if both are set).
        remote_encryption_key_file: path of a key file in the same format
            (its own keys: never the auth key file's bytes, which would
            still give independent keys): uploads are encrypted
            (AES-256-GCM, :mod:`ucm_db.remote.sealing`) with the first key
            and a remote object is served only if one of the keys opens it
            (a plaintext or undecryptable object is a miss). Needs the
            ``cryptography`` package. Never the key itself.
        remote_encryption_key_env: name of an environment variable holding
            encryption keys (after the file's, if both are set).
        read_only: open an existing store without writing anything: no
            lock file is created (an existing one is locked shared through
            a read-only descriptor), LMDB runs without its lock file where
            the file system is read-only, reader activity (LRU touches, hit
            counts) stays in memory, a corrupt block reads as a miss without
            a quarantine record, and ``put``/``delete`` raise
            :class:`~ucm_db.errors.TierError`. For a store on a read-only
            volume (a ``kv_consumer``). Never persisted.
        max_pinned_bytes: the most stored bytes pins may hold in the store
            (:meth:`ucm_db.Store.pin`; a pinned block and its ancestors are
            never evicted); a pin beyond it is refused with a
            :class:`~ucm_db.errors.StoreFullError` naming this setting. None
            (the default): half of ``capacity_bytes``; 0 refuses every pin;
            a value above ``capacity_bytes`` means ``capacity_bytes``.
            Checked when a pin is made (pins already made stay). Never
            persisted: each process pinning passes its own (the default
            follows the store's recorded capacity).
        check_on_open: ``"pages"`` reads every branch and leaf page of an
            existing LMDB store in a child process before this process maps
            it, and refuses a damaged store with a
            :class:`~ucm_db.errors.TierError` (LMDB would crash the process
            on such a page: SIGSEGV/SIGABRT); ``"none"`` skips it. Costs
            about 0.2-0.9 s (page cache warm) or 1.6-2.4 s (cold) per 100k
            blocks (RELIABILITY.md). Never persisted.
    """

    capacity_bytes: int = 8 * GIB
    codec: str = "zstd"
    zstd_level: int = 1
    durability: str = "group"
    sync_interval_s: float = 1.0
    sync_bytes: int = 32 * MIB
    engine: str = "lmdb"
    encode_threads: int = 2
    max_readers: int = 1024
    map_size_bytes: int | None = None
    remote: str | None = None
    remote_options: Mapping[str, Any] = field(default_factory=dict)
    remote_mode: str = "write_back"
    remote_deadline_s: float = 0.2
    upload_concurrency: int = 4
    remote_read_concurrency: int = 16
    remote_max_object_bytes: int = 256 << 20
    remote_lookup_max_bytes: int | None = None
    remote_codec: str = "same"
    remote_auth_key_file: str | None = None
    remote_auth_key_env: str | None = None
    remote_encryption_key_file: str | None = None
    remote_encryption_key_env: str | None = None
    read_only: bool = False
    check_on_open: str = "pages"
    max_pinned_bytes: int | None = None

    def __post_init__(self) -> None:
        _require_int("capacity_bytes", self.capacity_bytes, minimum=1 << 20, maximum=MAX_CAPACITY_BYTES)
        _require_choice("codec", self.codec, CODECS)
        _require_int("zstd_level", self.zstd_level, minimum=-7)
        if self.zstd_level > 22:
            raise ConfigError("zstd_level must be <= 22", hint="use 1 (fast) to 19 (small)")
        _require_choice("durability", self.durability, DURABILITIES)
        _require_positive_float("sync_interval_s", self.sync_interval_s, maximum=MAX_SYNC_INTERVAL_S, minimum=MIN_SYNC_INTERVAL_S)
        _require_int("sync_bytes", self.sync_bytes, minimum=1)
        _require_choice("engine", self.engine, ENGINES)
        if self.engine == "lmdb" and self.capacity_bytes > MAX_LMDB_CAPACITY_BYTES:
            raise ConfigError(
                f"capacity_bytes must be in [{1 << 20}, {MAX_LMDB_CAPACITY_BYTES}] for the lmdb engine, got {self.capacity_bytes}: "
                "LMDB maps the whole store (2 x capacity + 256 MiB) into the process, and ucm-db keeps maps within "
                f"{MAX_LMDB_MAP_BYTES >> 40} TiB of the 128 TiB a 64-bit Linux process can address",
                hint=f"lower capacity_bytes to at most {MAX_LMDB_CAPACITY_BYTES >> 40} TiB, or use engine='rocksdb' for a larger store",
            )
        _require_int("encode_threads", self.encode_threads, minimum=0)
        _require_int("max_readers", self.max_readers, minimum=8, maximum=MAX_READERS)
        if self.map_size_bytes is not None:
            _require_int("map_size_bytes", self.map_size_bytes, minimum=1 << 20, maximum=MAX_LMDB_MAP_BYTES)
        if self.remote is not None and (not isinstance(self.remote, str) or "://" not in self.remote):
            raise ConfigError(
                f"remote must be an fsspec URL such as s3://bucket/prefix, got {brief_value(self.remote)}",
                hint="write file:///abs/dir for a shared directory",
            )
        if self.remote is not None:
            scheme, _, where = self.remote.partition("://")
            if not where.strip() or (scheme == "file" and not where.startswith(("/", "~"))):  # file:// alone: the cwd
                raise ConfigError(
                    f"remote {brief_value(self.remote)} names no {'absolute directory' if scheme == 'file' else 'place'}",
                    hint="write file:///abs/dir or s3://bucket/prefix (an unset shell variable in file://$DIR expands to '')",
                )
        if not isinstance(self.remote_options, Mapping):
            raise ConfigError("remote_options must be a mapping", hint="pass a dict such as {'endpoint_url': ...}")
        if any(not isinstance(name, str) for name in self.remote_options):
            bad = next(name for name in self.remote_options if not isinstance(name, str))
            raise ConfigError(f"remote_options names must be strings, got {brief_value(bad)}",
                              hint="quote the option's name (YAML reads `1: x` as an integer name)")
        _require_choice("remote_mode", self.remote_mode, REMOTE_MODES)
        _require_positive_float("remote_deadline_s", self.remote_deadline_s, maximum=MAX_REMOTE_DEADLINE_S)
        _require_int("upload_concurrency", self.upload_concurrency, minimum=1)
        _require_int("remote_read_concurrency", self.remote_read_concurrency, minimum=1)
        _require_int("remote_max_object_bytes", self.remote_max_object_bytes, minimum=1 << 20, maximum=MAX_REMOTE_OBJECT_BYTES)
        if self.remote_lookup_max_bytes is not None:
            self._check_lookup_max_bytes()
        _require_choice("remote_codec", self.remote_codec, REMOTE_CODECS)
        _check_auth_settings(self)
        _check_key_settings(self, "remote_encryption_key", "encrypt remote objects", "--encryption-key-file")
        _require_choice("check_on_open", self.check_on_open, OPEN_CHECKS)
        if self.max_pinned_bytes is not None:
            _require_int("max_pinned_bytes", self.max_pinned_bytes, minimum=0, maximum=MAX_CAPACITY_BYTES)
        if not isinstance(self.read_only, bool):
            raise ConfigError(f"read_only must be true or false, got {brief_value(self.read_only)}", hint="pass read_only=True or omit it")
        if self.read_only and self.engine == "memory":
            raise ConfigError("read_only has no meaning for the memory engine (it starts empty)", hint="omit read_only")
        if self.read_only and self.remote is not None:
            raise ConfigError(
                "read_only and remote do not mix: blocks read through from the remote are kept in the local tier",
                hint="open the local store writable to use a remote tier, or drop remote to serve the read-only store alone",
            )

    def _check_lookup_max_bytes(self) -> None:
        """A set ``remote_lookup_max_bytes`` fits the largest object read."""
        assert self.remote_lookup_max_bytes is not None
        _require_int("remote_lookup_max_bytes", self.remote_lookup_max_bytes, minimum=1 << 20)
        if self.remote_lookup_max_bytes < self.remote_max_object_bytes:
            raise ConfigError(
                f"remote_lookup_max_bytes ({self.remote_lookup_max_bytes}) is below remote_max_object_bytes "
                f"({self.remote_max_object_bytes}): the largest object read would never fit a lookup",
                hint="raise remote_lookup_max_bytes to at least remote_max_object_bytes, or lower remote_max_object_bytes",
            )

    @property
    def pinned_limit_bytes(self) -> int:
        """The cap on pinned bytes this config gives (``max_pinned_bytes``,
        by default half of ``capacity_bytes``; never above the capacity)."""
        limit = self.capacity_bytes // 2 if self.max_pinned_bytes is None else self.max_pinned_bytes
        return min(limit, self.capacity_bytes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> StoreConfig:
        """Builds a config from a mapping; unknown keys are an error."""
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}",
                hint=f"valid options are: {', '.join(cls.field_names())}",
            )
        return cls(**dict(options))

    def persisted(self) -> dict[str, Any]:
        """The settings recorded in a store when it is created."""
        return {name: getattr(self, name) for name in PERSISTED_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """All fields, remote_options redacted (they may hold credentials)."""
        return redacted_options(dataclasses.asdict(self))

    def __repr__(self) -> str:
        """The fields as :meth:`to_dict` gives them: remote_options redacted
        (a traceback or a debug log never shows a credential)."""
        return f"StoreConfig({', '.join(f'{name}={value!r}' for name, value in self.to_dict().items())})"


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Store options as given (``ucm_db.open``'s keywords), their
    ``remote_options`` values redacted as :meth:`StoreConfig.to_dict` does."""
    out = dict(options)
    if isinstance(out.get("remote_options"), Mapping):
        out["remote_options"] = {k: "***" for k in out["remote_options"]}
    return out


def _check_auth_settings(config: StoreConfig) -> None:
    """The auth key settings name a file and a variable (the keys are read at
    open, :func:`ucm_db.auth.load_keys`), and only with a remote."""
    file, env = config.remote_auth_key_file, config.remote_auth_key_env
    if file is not None and (not isinstance(file, (str, Path)) or not str(file)):
        raise ConfigError(f"remote_auth_key_file must be a path, got {brief_value(file)}", hint="name the key file, never the key itself")
    if env is not None and (not isinstance(env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env)):
        raise ConfigError(f"remote_auth_key_env must name an environment variable, got {'a value' if isinstance(env, str) else repr(env)}",
                          hint="pass the variable's name (e.g. UCM_DB_AUTH_KEY), never the key itself")
    if (file is not None or env is not None) and config.remote is None:
        raise ConfigError("remote_auth_key_file/remote_auth_key_env authenticate remote objects, and no remote is set",
                          hint="set remote, or drop the auth key setting (archives take --auth-key-file)")


def _check_key_settings(config: StoreConfig, prefix: str, purpose: str, archive_flag: str) -> None:
    """``<prefix>_file`` names a file and ``<prefix>_env`` a variable (the
    keys are read at open), and only with a remote."""
    file, env = getattr(config, prefix + "_file"), getattr(config, prefix + "_env")
    if file is not None and (not isinstance(file, (str, Path)) or not str(file)):
        raise ConfigError(f"{prefix}_file must be a path, got a {type(file).__name__}", hint="name the key file, never the key itself")
    if env is not None and (not isinstance(env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env)):
        raise ConfigError(f"{prefix}_env must name an environment variable, got {'a value' if isinstance(env, str) else repr(env)}",
                          hint="pass the variable's name (e.g. UCM_DB_ENCRYPTION_KEY), never the key itself")
    if (file is not None or env is not None) and config.remote is None:
        raise ConfigError(f"{prefix}_file/{prefix}_env {purpose}, and no remote is set",
                          hint=f"set remote, or drop the setting (archives take {archive_flag})")


def brief_value(value: Any) -> str:
    """``value`` for an error message: at most about 60 characters, and never
    an exception (a setting may be a huge string or an int past ``str()``'s
    4300 digits, as a YAML hex literal reads; or nested past ``repr``'s
    recursion limit: ``!r`` of an alias bomb's value ran for minutes and grew
    past 6 GiB)."""
    try:
        if value is None or isinstance(value, (bool, float)) or (isinstance(value, int) and value.bit_length() <= 64):
            return repr(value)
        if isinstance(value, str):
            return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"
        if isinstance(value, int):
            return f"an integer of {value.bit_length()} bits"
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            return f"a {type(value).__name__} of {len(value)} items"
        return f"a {type(value).__name__}"
    except Exception:  # noqa: BLE001 - a str subclass's or a container's odd __len__
        return "a value"


def _require_int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {brief_value(value)}", hint=f"pass {name}=<int>")
    span = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
    if value < minimum:
        raise ConfigError(f"{name} must be {'in ' if maximum is not None else ''}{span}, got {brief_value(value)}",
                          hint=f"raise {name}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be in {span}, got {brief_value(value)}", hint=f"lower {name}")


def _require_positive_float(name: str, value: Any, *, maximum: float, minimum: float | None = None) -> None:
    # `not 0 < value <= maximum` also refuses NaN and infinity: a timer
    # given either would overflow (or never fire) in threading.Event.wait.
    low_ok = isinstance(value, (int, float)) and (value > 0 if minimum is None else value >= minimum)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok and value <= maximum):
        span = f"(0, {maximum:g}]" if minimum is None else f"[{minimum:g}, {maximum:g}]"
        raise ConfigError(f"{name} must be a number of seconds in {span}, got {brief_value(value)}", hint=f"pass e.g. {name}=0.5")


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {brief_value(value)}", hint=f"pass {name}={choices[0]!r}")


def persisted_settings_problem(settings: dict[str, Any]) -> str | None:
    """Why the persisted values of a settings record cannot be used (the
    field and the value, as the config check words it), or None."""
    try:
        StoreConfig.from_dict({name: settings[name] for name in PERSISTED_FIELDS if name in settings})
    except ConfigError as exc:
        return exc.message
    return None
