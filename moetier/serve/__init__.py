"""Text in, text out: completions over the engine with a model's tokenizer, and the OpenAI-compatible server.

`textgen` turns token streaming into text streaming (stop tokens, stop
strings, characters never split, logprobs); `tools` reads tool calls out of
a completion; `jsonmode` constrains one to a JSON object; `api` is the
OpenAI request and response shapes; `worker` runs generations (and a
request's n choices) one at a time on one thread over a kept prefix cache; `record`
writes each request as a session record and a routing trace; `server` is the
HTTP app (FastAPI on uvicorn). Nothing here imports torch or FastAPI until used.
"""
