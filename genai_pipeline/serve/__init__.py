"""`genai serve`: an OpenAI-compatible HTTP server over an export folder.

requests.py   OpenAI request bodies -> frozen dataclasses, every field and limit checked
engine.py     the sessions, the queue in front of them, prefix reuse, the generation threads
app.py        the routes (Starlette), server-sent events, errors as OpenAI's error objects; uvicorn
"""
