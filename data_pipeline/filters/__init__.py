"""What judges a document: quality heuristics (Gopher, C4, FineWeb), one file each, and
py3langid's language identification for a batch (``language_id.py``).

Each filter is ``filter(text, cfg) -> (reason | None, text)``: a reason names the first failed rule
(``gopher_quality:min_doc_words``); the returned text may be edited (C4 drops lines).
"""
