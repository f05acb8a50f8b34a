"""Other engines' streams, read with their own wire formats: vLLM's Prometheus metrics and KV-cache events.

Nothing here imports kvscope.engine: an adapter turns another engine's bytes into a
view state that the TUI draws, exactly as kvscope's own reducer does for its events.
"""
