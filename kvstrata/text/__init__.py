"""kvstrata.text: client-side text work. Tokenizers (``tokenizer.py``) and
the incremental detokenizer with stop strings (``detokenizer.py``); the
engine core itself deals only in token ids."""
