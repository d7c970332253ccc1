"""Seeded messy documents for the filter equivalence tests: what crawls contain and heuristics trip on.

Why generated: the bundled corpus is clean prose; these pages mix odd whitespace (no-break,
ideographic, separator controls, line separators), case changes that lengthen a word (``İ``) or
depend on context (final sigma), punctuation-only tokens, bullets, ellipses, repeated lines,
paragraphs and word spans, boilerplate and over-long words, so every rule of every filter decides
some of them. The same seed gives the same documents on every machine (numpy's PCG64).
"""

from __future__ import annotations

import numpy as np

WORDS = (
    "the be to of and that have with a in is it river stone light house water city night "
    "The THE And OF river, stone. (light) “house” ‘water’ city; night: "
    "İstanbul ΟΔΟΣ ὈΔΥΣΣΕΎΣ straße ǅemal café naïve e\u0301te 中文字 東京 👍 🙂 "
    "12345 3.14 a1 x_y #tag # ... … — – - -- *** ''' \"\" () [] "
    "javascript JavaScript lorem ipsum Lorem Ipsum { } [1] [edit] [citation needed] "
    "privacy policy cookies terms of use"
).split(" ")
SPACES = (" ", " ", " ", " ", "  ", "\t", "\u00a0", "\u2003", "\u3000", "\x1c", "\x85", "\u2028", "\x0b", "\u200b")
LINE_BREAKS = ("\n", "\n", "\n", "\n\n", "\n\n\n", "\r\n", "\n \n", "\n\t\n")
BULLETS = ("", "", "", "- ", "• ", "* ", "‣ ", "◦ ", "  - ", "\t• ")
ENDINGS = (".", ".", ".", "!", "?", "...", "…", "”", "'", '"', "", "", ":", ". ", ".\t")
LONG_WORD = "x" * 1200
SHORT = "a I x y z 1 2 - = + ok no is it of to an be the and".split()


def _line(rng: np.random.Generator, vocab: list[str], words: int) -> str:
    parts = [str(w) for w in rng.choice(vocab, size=words)]
    if rng.random() < 0.02:
        parts.insert(int(rng.integers(len(parts) + 1)), LONG_WORD)
    spaces = rng.choice(SPACES, size=len(parts))
    text = "".join(w + s for w, s in zip(parts, spaces)).rstrip()
    return str(rng.choice(BULLETS)) + text + str(rng.choice(ENDINGS))


def messy_document(rng: np.random.Generator, prose: list[str]) -> str:
    """One page: lines of words from ``prose`` (common words) and the odd vocabulary above, with
    some lines, paragraphs and word spans repeated."""
    kind = rng.random()
    if kind < 0.03:
        return str(rng.choice(["", " ", "\n\n", "\u3000", "word", "...", "\t\n"]))
    if kind < 0.08:
        prose = SHORT  # words too short on average
    share = float(rng.choice([0.0, 0.1, 0.3, 1.0]))  # share of odd words
    odd = rng.random(200) < share
    vocab = [WORDS[int(rng.integers(len(WORDS)))] if o else prose[int(rng.integers(len(prose)))] for o in odd]
    lines: list[str] = []
    for _ in range(int(rng.integers(1, 40))):
        roll = rng.random()
        if lines and roll < 0.12:
            lines.append(lines[int(rng.integers(len(lines)))])  # a repeated line
        elif len(lines) > 3 and roll < 0.17:
            start = int(rng.integers(len(lines) - 2))
            lines.extend(lines[start : start + 3])  # a repeated run of lines
        else:
            lines.append(_line(rng, vocab, int(rng.integers(1, 30))))
    text = "".join(line + str(rng.choice(LINE_BREAKS)) for line in lines)
    if rng.random() < 0.3:  # a repeated span of words
        words = text.split(" ")
        if len(words) > 12:
            at, span = int(rng.integers(len(words) - 11)), int(rng.integers(5, 12))
            words[at:at] = words[at : at + span] * int(rng.integers(1, 4))
            text = " ".join(words)
    return text if rng.random() < 0.9 else text.upper()


def messy_documents(count: int = 600, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    prose = (
        "the of and to in a is that it was for on are as with his they at be this from I have or by "
        "one had not but what all were when we there can an your which their said if do will each "
        "about how up out them then she many some so these would other into has more her two like "
        "him see time could no make than first been its who now people my made over did down only "
        "way find use may water long little very after words called just where most know"
    ).split()
    pages = [messy_document(rng, prose) for _ in range(count)]
    return pages + [" ".join(["the river"] * 50_001)]  # over gopher_quality.max_doc_words
