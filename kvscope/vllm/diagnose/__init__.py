"""`kvscope diagnose` for a watched vLLM: its signals, verdicts and the knobs in vLLM's own flags."""
