"""Fit time: labelled data -> calibration stored in the engine manifest (see the calibration issue)."""
