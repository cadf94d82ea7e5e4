"""An engine answering labelled rows, measured and corrected: `onepass calibrate`, `onepass eval`, `onepass
quantize`."""
