"""Prefill/decode roles (vLLM's ``kv_role``) and the publication record a
producer hands its consumers through ``kv_transfer_params``.

Roles:
    * ``kv_producer`` (prefill): loads its own hits and saves every block it
      computes. A step's blocks are committed (and, with ``publish="remote"``,
      uploaded: write-through) inside ``wait_for_save``, before the step's
      output leaves the engine, all KV-head units of a request in one
      transaction and by default uncompressed (``publish_codec``: zstd
      would triple the wait; an upload still uses the remote's codec);
      ``request_finished`` then returns a
      :class:`Publication` as the request's ``kv_transfer_params``. A save
      voided a step later (computed over another rank's failed load) is
      deleted locally and from the remote (worker/voids.py).
    * ``kv_consumer`` (decode): loads, never saves, so it never evicts a
      block on its own account. Given a producer's publication, it claims
      every published full block, waiting for blocks not yet visible (at
      most ``load_deadline_s`` per request) without holding up other
      requests; what is still missing then is recomputed.
    * ``kv_both`` (default): loads, and saves in the background (nothing
      waits for a commit). It honours a publication too.

Invariants:
    * Only plain values cross processes: a publication is a JSON-able dict
      under the single key :data:`PARAMS_KEY`, so it survives vLLM's HTTP
      responses, the PD proxy and the next request unchanged.
    * A publication is trusted only as a *count*: the consumer derives its
      own block keys from its own tokens and checks the last published key
      against them, so a publication for other tokens, another namespace
      or a malformed one is ignored (ordinary lookup), never loaded.
    * A consumer waits for one request at most ``load_deadline_s`` from its
      first lookup; the wait is a deferred lookup (vLLM schedules the
      request again later), so no KV blocks are held while waiting.
    * A publication names the stores that hold its blocks (``stores``:
      :func:`store_fingerprints` of the producer's local store and of its
      remote tier, if any). A consumer waits only for a publication naming
      a store it reads (or naming none: a producer from before the field);
      for any other it does an ordinary lookup: under a MultiConnector, a
      child on a local cache in front of the shared store would otherwise
      hold every PD request for ``load_deadline_s`` (blocks it never gets),
      and count them all as publication misses. Waiting is never what makes
      a load right (every claim is of blocks found stored), so a fingerprint
      that does not match only costs the wait's retries, never wrong KV.
    * A store is fingerprinted by what names it alike wherever it is read:
      a local store by its node (the kernel's boot id, shared by the
      containers of one host; the host name where there is none) and the
      directory's device and inode; a remote by its URL with the protocol's
      aliases merged (``s3a``/``s3n`` -> ``s3``, ``gcs`` -> ``gs``,
      ``local`` -> ``file``), trailing slashes dropped, and a ``file://``
      (or plain) directory by its resolved path on this node. Another
      spelling of one store is not recognised: an NFS export mounted at
      another path, another endpoint's alias of one bucket (docs/pd.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucm_db.config import brief_value
from ucm_db.errors import ConfigError

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm": vLLM's log handler prints it; imports no vLLM

ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: Where a producer publishes: its local store (consumers on this node share
#: the directory) or also the remote tier (consumers on other nodes).
PUBLISH_TARGETS = ("local", "remote")
#: Codecs of a producer's in-step commit; "store": the store's own ``codec``.
PUBLISH_CODECS = ("none", "zstd", "store")
#: The one key of ``kv_transfer_params`` that ucm-db reads and writes.
PARAMS_KEY = "ucm_db"
PARAMS_VERSION = 1
#: Shortest interval between two lookups of a request waiting for a publication.
RECHECK_INTERVAL_S = 0.005


@dataclass(frozen=True, slots=True)
class RolePolicy:
    """What a connector of one ``kv_role`` does."""

    role: str = "kv_both"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(ROLES)}, got {brief_value(self.role)}", hint="use \"kv_role\": \"kv_both\"")

    @classmethod
    def from_kv_role(cls, kv_role: str | None) -> RolePolicy:
        """vLLM's ``kv_role`` (None: ``kv_both``)."""
        return cls(kv_role or "kv_both")

    @property
    def saves(self) -> bool:
        """Saves computed blocks (producer, both)."""
        return self.role != "kv_consumer"

    @property
    def publishes(self) -> bool:
        """Commits within the step and announces what it committed."""
        return self.role == "kv_producer"


def check_publish_options(publish: str, load_deadline_s: float, publish_codec: str = "none") -> None:
    """Validates the connector's PD settings (raises ConfigError)."""
    if publish_codec not in PUBLISH_CODECS:
        raise ConfigError(f"publish_codec must be one of {', '.join(PUBLISH_CODECS)}, got {brief_value(publish_codec)}",
                          hint="use publish_codec='none' (fastest publication) or 'store' (the store's codec, smaller)")
    if publish not in PUBLISH_TARGETS:
        raise ConfigError(f"publish must be one of {', '.join(PUBLISH_TARGETS)}, got {brief_value(publish)}",
                          hint="use publish='local' (consumers share this store) or 'remote' (consumers on other nodes)")
    if isinstance(load_deadline_s, bool) or not isinstance(load_deadline_s, (int, float)) or not 0 <= load_deadline_s <= 600:
        raise ConfigError(f"load_deadline_s must be a number of seconds in [0, 600], got {brief_value(load_deadline_s)}",
                          hint="use e.g. load_deadline_s=5.0")


def producer_store_options(store_options: Mapping[str, Any], publish: str) -> dict[str, Any]:
    """Store options of a producer: ``publish="remote"`` needs a remote tier
    and uploads within the put (``remote_mode="write_through"``), so a
    published block is on the remote before its request's output leaves."""
    options = dict(store_options)
    if publish != "remote":
        return options
    if not options.get("remote"):
        raise ConfigError("publish='remote' needs a remote tier", hint="add \"remote\": \"s3://bucket/prefix\" (or file:///shared/dir) to the extra config")
    if options.get("remote_mode", "write_through") != "write_through":
        raise ConfigError(
            f"publish='remote' uploads within the step; remote_mode={options['remote_mode']!r} contradicts it",
            hint="drop remote_mode (a producer publishing remotely writes through)",
        )
    options["remote_mode"] = "write_through"
    return options


#: fsspec protocols that name the same stores as another (one bucket under either).
_PROTOCOL_ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs", "local": "file"}
_node: list[str] = []  # this node's identity, once read


def node_identity() -> str:
    """This node's identity: the kernel's boot id (one per host boot, shared
    by its containers), or the host name where the kernel has none."""
    if not _node:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
                _node.append("boot:" + file.read().strip())
        except OSError:
            _node.append("host:" + socket.gethostname())
    return _node[0]


def remote_name(remote: str) -> str:
    """A remote tier's URL as every spelling of it reads (module invariants)."""
    protocol, sep, rest = remote.partition("://")
    if not sep:  # a plain path: fsspec's local file system
        protocol, rest = "file", remote
    protocol = _PROTOCOL_ALIASES.get(protocol.lower(), protocol.lower())
    if protocol == "file":
        rest = os.path.realpath(rest)
    return f"{protocol}://{rest.rstrip('/')}"


def store_fingerprints(local_path: str | os.PathLike[str], remote: str | None) -> tuple[str, ...]:
    """Short digests naming where a store's blocks can be read: its local
    directory (this node, device and inode: the same directory under any
    mount path of one node) and its remote tier (:func:`remote_name`), if
    any. A directory that cannot be stat'ed is named by its resolved path."""
    try:
        status = os.stat(local_path)
        local = f"local:{node_identity()}:{status.st_dev}:{status.st_ino}"
    except OSError:
        local = f"path:{node_identity()}:{os.path.realpath(local_path)}"
    names = [local] + ([f"remote:{remote_name(remote)}"] if remote else [])
    return tuple(hashlib.blake2b(name.encode(), digest_size=8, person=b"ucm-db/store").hexdigest() for name in names)


@dataclass(frozen=True, slots=True)
class Publication:
    """What a producer committed for one request: the leading ``blocks``
    full blocks of its key chain under ``namespace_id`` (hex), the last of
    them keyed ``last_key`` (hex), held by the ``stores`` named
    (:func:`store_fingerprints`; empty: not said)."""

    namespace_id: str
    blocks: int
    block_size: int
    last_key: str
    target: str = "local"
    stores: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` a producer's ``request_finished`` returns."""
        return {PARAMS_KEY: {
            "version": PARAMS_VERSION, "namespace": self.namespace_id, "blocks": self.blocks,
            "block_size": self.block_size, "tokens": self.tokens, "last_key": self.last_key, "published_to": self.target,
            "stores": list(self.stores),
        }}

    @classmethod
    def from_params(cls, params: Any) -> Publication | None:
        """The publication in a request's ``kv_transfer_params``; None when
        there is none or it is malformed (see module invariants)."""
        if not isinstance(params, Mapping):
            return None
        body = params.get(PARAMS_KEY)
        if not isinstance(body, Mapping) or type(body.get("version")) is not int or body["version"] != PARAMS_VERSION:
            return None  # an array's == is no bool: typed first (a review's repro stopped the step)
        try:
            blocks, block_size = body["blocks"], body["block_size"]
            namespace_id, last_key = body["namespace"], body["last_key"]
            target = body.get("published_to", "local")
        except KeyError:
            return None
        if not (isinstance(blocks, int) and isinstance(block_size, int) and blocks >= 0 and block_size > 0):
            return None
        if not (isinstance(namespace_id, str) and isinstance(last_key, str) and isinstance(target, str)):
            return None
        stores = body.get("stores")
        # Not a list of names: not said (waited for as from a producer before the field).
        named = tuple(stores) if isinstance(stores, list) and all(isinstance(name, str) for name in stores) else ()
        return cls(namespace_id, blocks, block_size, last_key, target, named)

    def reaches(self, stores: tuple[str, ...]) -> bool:
        """Whether a reader of ``stores`` (its :func:`store_fingerprints`)
        reads a store this publication names (True where it names none)."""
        return not self.stores or not set(self.stores).isdisjoint(stores)

    def keys_match(self, namespace_id: str, block_size: int, keys: Any, max_blocks: int) -> bool | None:
        """Whether the consumer's own key for the publication's last block
        (``keys(n)``: its first ``n`` keys) is ``last_key``; None where the
        two cannot be compared (another namespace or block size, nothing
        published, a prompt too short for ``max_blocks``)."""
        if self.namespace_id != namespace_id or self.block_size != block_size or not 0 < self.blocks <= max_blocks + 1:
            return None
        chain = keys(self.blocks)
        return None if len(chain) < self.blocks else chain[self.blocks - 1].hex() == self.last_key

    def expected_blocks(self, namespace_id: str, block_size: int, keys: Any, max_blocks: int) -> int:
        """Blocks a consumer may count on: 0 unless :meth:`keys_match`."""
        return min(self.blocks, max_blocks) if self.keys_match(namespace_id, block_size, keys, max_blocks) else 0


class PublicationWaits:
    """Per request, since when a consumer waits for published blocks.

    ``decide`` answers each lookup: keep waiting (True) while fewer than the
    expected blocks are visible and the request's deadline has not passed.
    """

    def __init__(self, deadline_s: float, clock: Any = time.monotonic) -> None:
        self._deadline_s = float(deadline_s)
        self._clock = clock
        self._since: dict[str, float] = {}
        self._checked: dict[str, float] = {}
        self._foreign_told = False  # a publication whose keys are not this engine's was logged

    def expected(self, publication: Publication, namespace_id: str, block_size: int, keys: Any, max_blocks: int) -> int:
        """:meth:`Publication.expected_blocks`; a publication of this
        namespace whose keys are not the consumer's is logged once per engine
        (an engine reset since roots its keys apart: docs/pd.md)."""
        match = publication.keys_match(namespace_id, block_size, keys, max_blocks)
        if match is False and not self._foreign_told:
            self._foreign_told = True  # every later request would say the same
            logger.warning("ucm-db: a producer published other keys for this engine's prompt (one of the two reset "
                           "its cache since, or the prompt holds multimodal items numbered per process: docs/pd.md); "
                           "such requests are recomputed")
        return min(publication.blocks, max_blocks) if match else 0

    def decide(self, req_id: str, expected_blocks: int, visible_blocks: int) -> bool:
        """True: defer the request (look again later); False: claim what is visible."""
        if visible_blocks >= expected_blocks:
            return False
        now = self._clock()
        since = self._since.setdefault(req_id, now)
        if now - since >= self._deadline_s:
            return False
        self._checked[req_id] = now
        return True

    def too_soon(self, req_id: str) -> bool:
        """True if this request was looked up less than
        :data:`RECHECK_INTERVAL_S` ago (defer without a lookup)."""
        last = self._checked.get(req_id)
        return last is not None and self._clock() - last < RECHECK_INTERVAL_S

    def waited_s(self, req_id: str) -> float:
        since = self._since.get(req_id)
        return 0.0 if since is None else self._clock() - since

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._checked.pop(req_id, None)
