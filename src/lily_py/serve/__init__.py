"""OpenAI- and Anthropic-compatible HTTP server for lily_py (``lily-py serve``; the ``serve``
extra).

``protocol`` validates OpenAI requests and builds their responses, ``anthropic`` does the same for
Anthropic's Messages API (no HTTP in either), ``scheduler`` runs one generation at a time per
model with a bounded FIFO queue, ``app`` is the Starlette application, ``cli`` the
``lily-py serve`` command. See docs/serving.md and docs/serving-anthropic.md.
"""
