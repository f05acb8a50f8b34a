"""Where the app's events come from: a live engine (live.py), a recorded trace (replay.py), the traces of a compare (runs.py)."""
