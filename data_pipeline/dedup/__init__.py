"""The machinery of exact and near dedup: document keys, MinHash signatures, LSH bands, the
partitioned union-find clustering, the saved near-dedup index, and removing a shard's duplicates.
The stages that run them are ``stages/exact_dedup.py`` and ``stages/near_dedup.py``.
"""
