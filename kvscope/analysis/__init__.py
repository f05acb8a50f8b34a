"""Analysis of recorded runs: calibration, diagnosis, what-if."""
