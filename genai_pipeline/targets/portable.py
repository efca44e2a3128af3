"""Portable: no delegate; every op runs on ExecuTorch's portable kernels. The reference target."""

from genai_pipeline.targets.target import Target

TARGET = Target(
    name="portable",
    description="ExecuTorch portable kernels, no delegate (reference)",
    recipes=("fp32",),
    partitioners=list,
)
