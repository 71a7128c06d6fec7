"""Reading a store config file (YAML or JSON) into the options dict
:meth:`ucm_db.config.StoreConfig.from_dict` validates (``ucm_db.load_config_file``,
and the connector's ``config_file`` setting).

Invariants:
    * Only a regular file of at most :data:`MAX_CONFIG_FILE_BYTES` of UTF-8
      is read (a FIFO, a device or a crafted file never stalls or exhausts
      a start); YAML is parsed safely, at most :data:`MAX_CONFIG_DEPTH`
      deep and without aliases, before any value is built.
    * Every problem is a :class:`~ucm_db.errors.ConfigError` naming the
      file and the fix.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ucm_db.errors import ConfigError

#: Largest config file read, deepest nesting parsed: a FIFO, a device or a crafted file must not stall or exhaust a start.
MAX_CONFIG_FILE_BYTES, MAX_CONFIG_DEPTH = 1 << 20, 32


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Reads a YAML or JSON config file into a dict (not yet validated): a regular file of at most :data:`MAX_CONFIG_FILE_BYTES`
    of UTF-8; YAML nested at most :data:`MAX_CONFIG_DEPTH` deep, without aliases (an alias bomb expands once a value is printed)."""
    import yaml  # a dependency; imported here, as only config files need it
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str) or "\0" in text:  # pathlib's own ValueError or TypeError otherwise
        raise ConfigError(f"config file must be a path without NUL characters, got a {type(path).__name__}",
                          hint="name a YAML or JSON file, e.g. load_config_file('/etc/ucm-db.yaml')")
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
    try:
        if not stat.S_ISREG((info := path.stat()).st_mode) or info.st_size > MAX_CONFIG_FILE_BYTES:
            raise ConfigError(f"config file {path} is not a regular file of at most {MAX_CONFIG_FILE_BYTES} bytes",
                              hint="name a YAML or JSON file, not a directory, FIFO or device")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}",
                          hint="check the path and its permissions; the file must be UTF-8 text") from exc
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader) if kind == "YAML" else ():  # before any value is built
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if isinstance(event, yaml.AliasEvent) or depth > MAX_CONFIG_DEPTH:
                why = f"values nested over {MAX_CONFIG_DEPTH} deep" if depth > MAX_CONFIG_DEPTH else "an alias (write the value out in full)"
                raise yaml.MarkedYAMLError(problem=why, problem_mark=event.start_mark)
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:  # ValueError: also an int of over 4300 digits
        mark = getattr(exc, "problem_mark", None)
        where = f"{getattr(exc, 'problem', None)} at line {mark.line + 1}, column {mark.column + 1}" if mark else " ".join(str(exc).split())
        raise ConfigError(f"config file {path} is not valid {kind}: {where[:200]}", hint=f"fix the {kind}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values", hint="write key: value lines")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"config file {path} has option name(s) that are not strings: {', '.join(repr(k)[:40] for k in odd[:5])}",
                          hint="option names are words such as capacity_bytes; quote them if YAML reads them as numbers")
    return data
