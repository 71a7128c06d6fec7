"""``ucm-db proxy``: the disaggregated-prefill proxy as a command
(:mod:`ucm_db.tools.proxy`, loaded only when it runs: FastAPI, httpx and
uvicorn stay out of every other command's start)."""

from __future__ import annotations

import click


@click.command("proxy", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def proxy_command(args: tuple[str, ...]) -> None:
    """Serve an OpenAI-compatible endpoint that prefills on --prefill servers
    and decodes on --decode servers sharing a ucm-db store (``ucm-db proxy
    --help`` for its options).

    \b
    Example:
        ucm-db proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    """
    from ucm_db.tools.proxy import main

    main.main(args=list(args), prog_name="ucm-db proxy", standalone_mode=True)
