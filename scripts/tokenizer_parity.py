"""moetier's tokenizer against llama.cpp's on real vocabularies: the vocab-only GGUFs llama.cpp tests with.

    .venv/bin/python scripts/tokenizer_parity.py DIR      # DIR: llama.cpp's models/ (ggml-vocab-*.gguf)

Takes every ggml-vocab-*.gguf in DIR (llama.cpp's source tree has them under models/; the llama-cpp-python
sdist under vendor/llama.cpp/models/), tokenizes tests/tokenizer_text.py's mixed text and, where present, the
file's own .inp test text with moetier (moetier.model.tokenizer) and with llama.cpp (`Llama.tokenize`,
llama-cpp-python), special tokens parsed or not, BOS or not, and checks that decoding gives the text back.
Prints a table, then one JSON line. Vocabularies moetier refuses (bert, t5, gemma4, ...) are listed as such.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tokenizer_text import MIXED_TEXT  # noqa: E402

from moetier.model.tokenizer import TokenizerError, load_tokenizer  # noqa: E402


def compare(path: Path) -> dict:
    from llama_cpp import Llama

    begin = time.perf_counter()
    try:
        ours = load_tokenizer(path)
    except TokenizerError as err:
        return {"vocab": path.name, "refused": str(err).split(": ", 1)[-1]}
    load_s = time.perf_counter() - begin
    llama = Llama(str(path), vocab_only=True, verbose=False)
    extra = path.with_name(path.name + ".inp")
    texts = [MIXED_TEXT] + ([extra.read_text(encoding="utf-8")] if extra.exists() else [])
    tokens, mismatches = 0, []
    for n, text in enumerate(texts):
        for special in (False, True):
            for bos in (False, True):
                expected = llama.tokenize(text.encode(), add_bos=bos, special=special)
                got = ours.encode(text, add_special=bos, parse_special=special)
                tokens += len(expected)
                if got != expected:
                    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
                    mismatches.append(f"text {n} special={special} bos={bos}: first difference at token {first}")
    return {"vocab": path.name, "vocab_size": ours.vocab_size, "tokens": tokens, "equal": not mismatches,
            "round_trip": ours.decode(ours.encode(MIXED_TEXT)) == MIXED_TEXT, "load_s": round(load_s, 3),
            "mismatches": mismatches}


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit(f"usage: {sys.argv[0]} DIR  (a folder of llama.cpp's ggml-vocab-*.gguf files)")
    rows = [compare(path) for path in sorted(Path(sys.argv[1]).glob("ggml-vocab-*.gguf"))]
    print(f"{'vocabulary':34} {'size':>7} {'tokens':>7}  equal  round trip  load s")
    for r in rows:
        if "refused" in r:
            print(f"{r['vocab']:34} refused: {r['refused']}")
        else:
            print(f"{r['vocab']:34} {r['vocab_size']:7d} {r['tokens']:7d}  {str(r['equal']):5}  {str(r['round_trip']):10}  {r['load_s']:.2f}")
    compared = [r for r in rows if "refused" not in r]
    print(json.dumps({"vocabularies": len(compared), "equal": sum(r["equal"] for r in compared),
                      "tokens": sum(r["tokens"] for r in compared), "refused": [r["vocab"] for r in rows if "refused" in r],
                      "rows": rows}))


if __name__ == "__main__":
    main()
