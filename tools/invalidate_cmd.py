"""``ucm-db invalidate``: stop serving a model's stored KV (after a weight update).

Moves each chosen namespace's epoch on through
:func:`ucm_db.maintenance.invalidate`: engines find none of its old blocks
from their next lookup on, and the blocks age out through LRU eviction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import ConfigError, maintenance

from ucm_db.tools.cli_common import CliPath, auth_options, emit, encryption_options, json_option
from ucm_db.tools.remote_cmds import parse_options

_REMOTE_NOTES = {
    None: "",
    "claimed": "; claimed on the remote above every node's epoch",
    "pending": ("; taken without the remote (a fresh epoch, which no node can have counted to): the remote learns it at "
                "this store's next contact with it"),
}


def render(report: dict[str, Any]) -> str:
    return "\n".join(
        f"namespace {row['namespace']} ({row['model']}): epoch {row['epoch']}; its older blocks are no longer served"
        + _REMOTE_NOTES[row.get("remote")]
        for row in report["invalidated"]
    )


@click.command("invalidate")
@click.argument("path", type=CliPath())
@click.option("--namespace", "namespaces", multiple=True, required=True,
              help="Namespace id prefix or model name (repeatable); `ucm-db inspect` lists them. An empty one is refused (exit 2).")
@click.option("--remote", default=None, help="fsspec URL of the store's remote tier: the new epoch is claimed there, "
              "above every epoch the nodes sharing it took.")
@click.option("--option", "options", multiple=True, help="fsspec option NAME=VALUE for --remote; repeatable.")
@auth_options("sign the remote's epoch (the fleet's key, required on a keyed remote)")
@encryption_options("open a store that used the remote encrypted (its queued uploads go encrypted)")
@json_option
def invalidate_command(path: Path, namespaces: tuple[str, ...], remote: str | None, options: tuple[str, ...],
                       auth_key_file: Path | None, auth_key_env: str | None, encryption_key_file: Path | None,
                       encryption_key_env: str | None, as_json: bool) -> None:
    """Invalidate a model's stored KV blocks (e.g. after its weights
    changed): its namespace's epoch moves on, so running and future engines
    of that model never serve a block stored before. Nothing is deleted:
    the old blocks leave through LRU eviction (or `ucm-db compact
    --target-bytes`). A namespace whose epoch record was damaged or lost
    gets a fresh epoch, never a reused one. An empty --namespace (e.g. an
    unset "$MODEL") is a usage error (exit 2), never "every namespace".
    On a store that shares the namespace with a remote, pass --remote (and
    its --option and key flags, as the store's server does): the new epoch
    is claimed there above every node's. Without it (or with the remote
    down) the namespace gets a fresh epoch, which no node can have counted
    to, and the remote learns it at the store's next contact.

    \b
    Example:
        ucm-db invalidate /var/cache/ucm-db --namespace 3f2a9c
        ucm-db invalidate /var/cache/ucm-db --namespace Qwen/Qwen2.5-0.5B \\
            --remote s3://kv-cache/prod --option endpoint_url=http://minio:9000
    """
    settings: dict[str, Any] = {}
    if remote is not None:
        settings = {"remote": remote, "remote_options": parse_options(options),
                    "remote_auth_key_file": None if auth_key_file is None else str(auth_key_file),
                    "remote_auth_key_env": auth_key_env, "remote_encryption_key_file":
                    None if encryption_key_file is None else str(encryption_key_file),
                    "remote_encryption_key_env": encryption_key_env}
    elif options or auth_key_file or auth_key_env or encryption_key_file or encryption_key_env:
        raise ConfigError("--option and the key flags of invalidate go with --remote", hint="pass --remote URL too")
    emit(as_json, {"invalidated": maintenance.invalidate(path, namespaces, **settings)}, render)
