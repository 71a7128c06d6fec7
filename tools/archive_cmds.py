"""``ucm-db export`` / ``ucm-db import``: a portable archive of namespaces.

The archive format and the checks on import are :mod:`ucm_db.maintenance.archive`'s
(through :mod:`ucm_db.maintenance`); this module parses and renders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ucm_db import maintenance

from ucm_db.tools.cli_common import EXIT_OK, EXIT_PROBLEMS, CliPath, ProgressBar, auth_options, emit, encryption_options, json_option


@click.command("export")
@click.argument("path", type=CliPath())
@click.argument("archive", type=CliPath())
@click.option("--namespace", "namespaces", multiple=True, help="Only this namespace (id prefix or model name); repeatable. Default: all.")
@auth_options("sign the archive (MACs)")
@encryption_options("encrypt the archive's blocks (AES-256-GCM)")
@json_option
def export_command(path: Path, archive: Path, namespaces: tuple[str, ...], auth_key_file: Path | None, auth_key_env: str | None,
                   encryption_key_file: Path | None, encryption_key_env: str | None, as_json: bool) -> None:
    """Write the blocks of chosen namespaces to a portable tar ARCHIVE
    (JSON manifest + encoded blocks). Read-only on the store. ARCHIVE is
    written beside itself under a temp name with the store's permissions
    and renamed into place (the temp file of an export killed mid-write
    is removed by the next export to that directory); an existing ARCHIVE
    that is not a regular file (symlink, directory, FIFO, device, `-`) is
    refused (exit 2). With an
    auth key the archive carries MACs (HMAC-SHA256) that `import` checks.
    The archive carries each namespace's invalidation epoch (covered by the
    MAC); a namespace whose epoch the store cannot establish is refused
    (exit 1: `ucm-db invalidate` it first). With an encryption key every
    block is encrypted (AES-256-GCM, bound to its key, parent, namespace and
    epoch); the manifest (model, keys, epochs) stays readable. `import`
    then needs the key. A block that does not verify under its key is left
    out with its descendants and named (exit 1: `ucm-db verify PATH --fix`
    quarantines it).

    \b
    Example:
        ucm-db export /var/cache/ucm-db qwen.tar --namespace Qwen/Qwen2.5-0.5B --auth-key-file /etc/ucm-db/auth.key
        ucm-db export /var/cache/ucm-db qwen.tar --encryption-key-file /etc/ucm-db/encryption.key
    """
    with ProgressBar(not as_json, "exporting") as bar:
        report = maintenance.export_archive(path, archive, namespaces, progress=bar, auth_key_file=auth_key_file, auth_key_env=auth_key_env,
                                            encryption_key_file=encryption_key_file, encryption_key_env=encryption_key_env)
    emit(as_json, report, lambda r: f"exported {r['blocks']} {'encrypted ' if r['encrypted'] else ''}blocks ({r['stored_bytes']} bytes) "
         f"of {len(r['namespaces'])} namespace(s) "
         f"to {r['archive']}, with their epochs ({', '.join(f'{ns[:16]}: {e}' for ns, e in sorted(r['epochs'].items())) or 'none'})"
         + (f"; {r['left_out']} blocks left out (evicted, deleted or corrupt, with their descendants)" if r.get("left_out") else "")
         + "".join(f"\n  corrupt, left out: {c['key'][:16]}: {c['reason']}" for c in r["corrupt"])
         + (f"\n  run `ucm-db verify {path} --fix` to quarantine the corrupt blocks" if r["corrupt"] else ""))
    raise SystemExit(EXIT_PROBLEMS if report["corrupt"] else EXIT_OK)


@click.command("import")
@click.argument("archive", type=CliPath())
@click.argument("path", type=CliPath())
@click.option("--allow-evict", is_flag=True, help="Let the import evict least recently used blocks when the archive does not fit.")
@auth_options("check the archive's MACs (refuse what they did not sign)")
@encryption_options("decrypt an encrypted archive (required for one)")
@json_option
def import_command(archive: Path, path: Path, allow_evict: bool, auth_key_file: Path | None, auth_key_env: str | None,
                   encryption_key_file: Path | None, encryption_key_env: str | None, as_json: bool) -> None:
    """Load an ARCHIVE written by `ucm-db export` into the store at PATH
    (created if missing). Every block is verified; bad ones and their
    descendants are skipped and reported (exit status 1). If the new blocks
    do not fit in the store's free capacity, nothing is imported (exit 1)
    unless --allow-evict lets it evict least recently used blocks. With an
    auth key, an archive without a valid MAC is refused and a block whose
    MAC fails is skipped. The archive carries each namespace's epoch
    (issue 48): the store takes the higher of its own and the archive's
    before any block is written, so blocks invalidated at the source stay
    unserved; a namespace whose epoch the store cannot establish is
    reported (exit 1). An archive of an older ucm-db carries no epoch:
    the store's epochs are kept. An encrypted archive needs
    --encryption-key-file (or --encryption-key-env), and a key needs an
    encrypted archive (exit 2 otherwise, nothing written); a block no key
    opens is skipped.

    \b
    Example:
        ucm-db import qwen.tar /var/cache/ucm-db --auth-key-file /etc/ucm-db/auth.key
        ucm-db import qwen.tar /var/cache/ucm-db --encryption-key-file /etc/ucm-db/encryption.key
    """
    with ProgressBar(not as_json, "importing") as bar:
        report = maintenance.import_archive(archive, path, progress=bar, allow_evict=allow_evict,
                                            auth_key_file=auth_key_file, auth_key_env=auth_key_env,
                                            encryption_key_file=encryption_key_file, encryption_key_env=encryption_key_env)

    def human(r: dict[str, Any]) -> str:
        lines = [f"imported {r['stored']} blocks ({r['already_present']} already present), skipped {len(r['skipped'])}"
                 + (f", evicted {r['evicted']} stored blocks" if r["evicted"] else "")]
        lines += [f"  skipped {s['key'][:16]}: {s['reason']}" for s in r["skipped"]]
        lines += [f"namespace {ns[:16]}: epoch {'unknown' if e['epoch'] is None else e['epoch']}"
                  + (f" (the archive's: {e['carried']})" if e["carried"] is not None else "")
                  + (f"; {e['note']}" if e["note"] else "") for ns, e in sorted(r["epochs"].items())]
        return "\n".join(lines + [f"  not served: {p}" for p in r["epoch_problems"]])

    emit(as_json, report, human)
    raise SystemExit(EXIT_PROBLEMS if report["skipped"] or report["epoch_problems"] else EXIT_OK)
