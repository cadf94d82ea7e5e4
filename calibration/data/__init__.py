"""Labelled rows and the data sets they come from: tune's rows (parsed with one-line errors, grouped and split by
whole state), the default adapter's training mixture and the data sets held out from it, BIG-bench, generated rows."""
