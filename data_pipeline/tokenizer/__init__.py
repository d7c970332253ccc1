"""Tokenizers: the released DeepSeek specs (``specs/*.json``, read by ``spec.py``), byte-level BPE
training on a spec (``training.py``) and fill-in-the-middle encoding (``fim.py``). The stages that
train and pack are ``stages/train_tokenizer.py`` and ``stages/tokenize_pack.py``.
"""
