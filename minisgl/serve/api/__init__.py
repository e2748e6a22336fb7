"""The HTTP API: routes (server), request bodies (protocol), the engine client, SSE, metrics."""
