"""``kvreuse engine``: a simulated vLLM replica (OpenAI API, prefix cache, KV events, metrics).

I/O lives here: it serves HTTP and publishes ZeroMQ events. The cache inside is the pure
:class:`~kvreuse.index.BlockIndex`, so hits, eviction and events follow vLLM's rules.
"""
