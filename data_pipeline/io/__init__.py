"""Files in and out: the work directory's document shards and markers (``shards.py``), the
input's row ranges (``input_splits.py``), the output directory's claim (``output_dir.py``), the
packed token shards (``packed_writer.py``) and a small document reader (``sources.py``).
"""
