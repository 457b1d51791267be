"""kvstrata.text: client-side text work. Tokenizers (``tokenizer.py``), the
one path that turns prompts of every kind into token ids without holding the
event loop (``prompts.py``: bounds, chat rendering, blend segments, worker
threads) and the incremental detokenizer with stop strings
(``detokenizer.py``); the engine core itself deals only in token ids."""
