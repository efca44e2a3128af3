"""Comparison studies and A/B scripts, each run from the repository's root as `python -m bench.<script>`
(bench/README.md); harness.py and peers.py are what they share."""
