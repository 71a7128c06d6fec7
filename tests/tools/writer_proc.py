"""A writer process for the compact tests: puts 4-block chains until a stop
file appears, printing the number of each chain after its put committed."""

from __future__ import annotations

import hashlib
import os
import sys
import time

import ucm_db
from ucm_db import Namespace

NS = Namespace(model="test/writer", kv_dtype="bfloat16", block_size=16)
BLOCKS = 4


def chain(i: int) -> tuple[list[bytes], list[bytes]]:
    keys = NS.block_keys([i * 1000 + j for j in range(BLOCKS * NS.block_size)])
    return keys, [hashlib.shake_256(b"%d/%d" % (i, j)).digest(8192) for j in range(BLOCKS)]


def main(path: str, stop_file: str) -> None:
    with ucm_db.open(path) as store:
        i = 0
        while not os.path.exists(stop_file):
            keys, payloads = chain(i)
            store.put(NS, keys, payloads)
            print(i, flush=True)
            i += 1
            time.sleep(0.005)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
