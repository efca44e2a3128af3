"""Every patch, fork or private use of torch, ExecuTorch and torchao internals, one module per thing
patched, each guarded by the versions in pins.py (docs/upstream-patches.md lists them all):

- pins.py: the pinned torch / ExecuTorch / torchao versions and the check every module here calls.

This package imports only torch, ExecuTorch, torchao and `genai_pipeline.errors`; anyone may use it.
"""
