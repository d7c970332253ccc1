"""Document quality heuristics (Gopher, C4, FineWeb), one file each.

Each filter is ``filter(text, cfg) -> (reason | None, text)``: a reason names the first failed rule
(``gopher_quality:min_doc_words``); the returned text may be edited (C4 drops lines).
"""
