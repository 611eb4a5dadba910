"""OpenAI's HTTP API for pods and routers: request parsing (params), responses (render),
errors, the app (Starlette) and its listener (uvicorn). See backend.py for how a pod or a
router plugs in."""

from pagekv.proto.openai.backend import Backend, CallContext
from pagekv.proto.openai.server import HttpServer

__all__ = ["Backend", "CallContext", "HttpServer"]
