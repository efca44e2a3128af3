"""The export-friendly models every family is built from: the one decoder and the one vision tower."""
