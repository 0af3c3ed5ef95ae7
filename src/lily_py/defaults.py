"""The defaults of ``load()`` and ``generate()`` that the CLI, the server and the README quote,
in one module that imports nothing (the CLI's ``--help`` reads them without loading numpy or the
compiled core; README.md's defaults table is generated from ``load()``'s signature).

``context_length`` has no constant here: its default is the checkpoint's
``max_position_embeddings`` (262,144 for Qwen3.6-35B-A3B) on every backend; engine backends grow
the KV cache in blocks as positions advance, so a long limit costs memory only when used.
"""
DEFAULT_PREFILL_CHUNK = 4096          # load(prefill_chunk=): tokens per prefill step
DEFAULT_MAX_TOKENS = 256              # generate()'s and the CLI's --max-tokens default
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # load(prompt_cache_bytes=): the prompt cache's budget
