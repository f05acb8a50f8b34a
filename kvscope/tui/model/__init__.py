"""The view-model: the state the reducer folds events into, and what the screens read from it (histograms, the step index, the player, the runs of a compare). No textual."""
