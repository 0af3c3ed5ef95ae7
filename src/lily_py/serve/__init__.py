"""OpenAI-compatible HTTP server for lily_py (``lily-py serve``; the ``serve`` extra).

``protocol`` validates requests and builds responses (no HTTP), ``scheduler`` runs one generation
at a time per model with a bounded FIFO queue, ``app`` is the Starlette application, ``cli`` the
``lily-py serve`` command. See docs/serving.md.
"""
