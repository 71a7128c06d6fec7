"""The serving benchmark's model: a random-weight Llama with a locally built
tokenizer, so vLLM's OpenAI server and its load generator can take text.

Invariants:
    * Nothing is downloaded: weights are random (``transformers`` +
      ``save_pretrained``) and the tokenizer is a word-level vocabulary
      built here (``tokenizers``), one token per whitespace-separated word.
    * The tokenizer has exactly the model's ``vocab_size`` ids and every id
      decodes to a word that encodes back to that id alone, so the load
      generator's prompts have the token counts it asked for.
    * Words are two or three lowercase letters: with the space between
      them a token is at most 4 characters, under the 5 characters per
      token that vLLM's server allows a prompt before it tokenizes it
      (longer words made every request a 400 "maximum context length").
    * A model directory is written whole to a temp directory and renamed:
      a half-written one is never reused.
"""

from __future__ import annotations

import itertools
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ucm_db.tools.bench.engine_pass import build_model, demo_dir

VOCAB_SIZE = 8000  # build_model's vocabulary
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3; build_model's bos=1, eos=2


#: The serving model's default width (build_model's).
DEFAULT_HIDDEN = 768


def serve_model_dir(layers: int, hidden: int = DEFAULT_HIDDEN) -> Path:
    """Where the ``layers``-layer serving model of width ``hidden`` is
    cached (beside the demo's; the default width keeps its old name)."""
    width = "" if hidden == DEFAULT_HIDDEN else f"-h{hidden}"
    return demo_dir() / f"serve-llama-{layers}l{width}-tok2"


def build_serve_model(layers: int = 8, out_dir: Path | None = None, hidden: int = DEFAULT_HIDDEN) -> Path:
    """A random-weight bf16 Llama (width ``hidden``, 768 by default; a
    multiple of 64) with a tokenizer; reused if present."""
    out_dir = out_dir or serve_model_dir(layers, hidden)
    if (out_dir / "tokenizer.json").exists() and (out_dir / "config.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent))
    model = build_model(tmp / "model", layers=layers, hidden=hidden)
    write_tokenizer(model, VOCAB_SIZE)
    model.rename(out_dir)  # atomic: weights and tokenizer together or not at all
    tmp.rmdir()
    return out_dir


def _words() -> Iterator[str]:
    """Two-letter words, then three-letter words (26**2 + 26**3 of them)."""
    for length in (2, 3):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield "".join(letters)


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Saves a word-level tokenizer of ``vocab_size`` ids into ``model_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for word in _words():
        if len(vocab) == vocab_size:
            break
        vocab[word] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(model_dir)
