"""``kvreuse route``: an OpenAI-compatible gateway that sends each request where its prefix lives.

I/O lives here (HTTP, ZeroMQ, files, clocks); the decisions are the pure policies of
:mod:`kvreuse.routing`, the very objects the simulator uses.
"""
