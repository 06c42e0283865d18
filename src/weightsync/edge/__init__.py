"""weightsync.edge: what every front door of weightsync shares, in pure Python.

The worker's HTTP app (:mod:`weightsync.serve`) and the router (:mod:`weightsync.router`) both
import these and never each other: who may talk to a service (:mod:`.origin`) and the ASGI
middleware that applies it (:mod:`.guard`), a service's Prometheus series (:mod:`.metrics`, the
one module that loads a third-party client), values read from a command line the way a route
reads a body (:mod:`.arguments`), what vLLM's and SGLang's routes look like wherever
weightsync serves them (:mod:`.dialects`), and what Dynamo's ``engine_rpc`` forms of the
``/engine/*`` routes mean (:mod:`.dynamo`).
"""
