"""``python -m mlx_mtp.server``: an OpenAI-compatible HTTP server (and Anthropic's Messages API)
that decodes with MTP.

  schema.py     request bodies -> a checked GenerationRequest (mlx_lm.server's fields and defaults)
  anthropic.py  the Messages API: its bodies -> a GenerationRequest, its answers and stream events
  engine.py     the loaded model: prompt ids, then Started / Delta / Finished events
  output.py     generated tokens -> content, reasoning, tool calls, logprobs (mlx-lm's parsers)
  worker.py     the one decode thread and its bounded FIFO queue
  responses.py  OpenAI response bodies, each ending one with usage and an ``mtp`` object
  app.py        the Starlette routes, server-sent events, disconnects
  split.py      ``--split``: rank 0 sends each request to the other ranks; they follow in lockstep
  __main__.py   the command line (uvicorn)

Needs the ``server`` extra: ``pip install 'mlx-mtp[server]'`` (starlette, uvicorn).
"""
