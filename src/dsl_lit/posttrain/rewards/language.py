"""R1's language-consistency reward: the share of the reasoning's words in the target language.

DeepSeek-R1 added it because RL mixed languages in the chain of thought. Words are told apart by
script: each CJK character counts as one word; a run of letters is a word of the script of its
letters (Latin for ``en``, Cyrillic for ``ru``, ...). Digits and punctuation are not words.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from dsl_lit.posttrain.rewards.format import think_block

SCRIPTS = {"en": "LATIN", "fr": "LATIN", "de": "LATIN", "es": "LATIN", "ru": "CYRILLIC", "el": "GREEK",
           "zh": "CJK", "ja": "CJK", "ko": "HANGUL"}
_WORD = re.compile(r"[^\W\d_]+", re.UNICODE)


def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    for script in ("CJK", "HIRAGANA", "KATAKANA", "HANGUL", "LATIN", "CYRILLIC", "GREEK", "ARABIC", "HEBREW"):
        if name.startswith(script) or f" {script} " in f" {name} ":
            return "CJK" if script in ("HIRAGANA", "KATAKANA") else script
    return "OTHER"


def _words(text: str) -> list[str]:
    """Scripts of the words of ``text``: one per CJK/kana character, one per run of other letters."""
    scripts: list[str] = []
    for run in _WORD.findall(text):
        current = ""
        for ch in run:
            script = _script(ch)
            if script == "CJK":
                scripts.append("CJK")
                current = ""
            elif script != current:
                scripts.append(script)
                current = script
    return scripts


def target_language_share(text: str, language: str = "en") -> float:
    """Share of the words of ``text`` written in ``language``'s script (0.0 when there are none)."""
    if language not in SCRIPTS:
        raise ValueError(f"language={language!r} is unknown; choose one of {sorted(SCRIPTS)}")
    words = _words(text)
    return sum(w == SCRIPTS[language] for w in words) / len(words) if words else 0.0


def language_consistency_reward(completion: str, sample: Mapping[str, Any] | None = None,
                                language: str | None = None) -> float:
    """Target-language share of the reasoning (the ``<think>`` block, else the whole completion);
    the language is ``language``, else ``sample["language"]``, else English."""
    language = language or (sample or {}).get("language", "en")
    reasoning = think_block(completion)
    return target_language_share(completion if reasoning is None else reasoning, language)
