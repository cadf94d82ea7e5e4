"""Fit time: labelled data -> calibration stored in the engine manifest, and tuning (docs/tune.md)."""
