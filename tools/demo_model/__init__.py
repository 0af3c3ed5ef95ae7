"""The stages of tools/make_demo.py, one module each: ``common`` (the model's config, its
added tokens, the fixed prompts, paths and logging), ``data`` (1-3: the KJV corpus, the tokenizer,
the training windows), ``train`` (4), ``export`` (5: the Hugging Face folder and mlx-lm's
conversion), ``check`` (6: mlx-lm's greedy record, cross-checked by transformers) and ``readme``
(the shipped folder's README)."""
