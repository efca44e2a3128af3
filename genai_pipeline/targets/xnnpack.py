"""XNNPACK: ExecuTorch's CPU delegate (x86 and Arm). Delegated weights are stored as named data
keyed by content, so the methods of one program share a single copy."""

from genai_pipeline.targets import Target


def _partitioners() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


TARGET = Target(
    name="xnnpack",
    description="CPU via the XNNPACK delegate",
    recipes=("fp32", "8da4w", "8da8w"),
    partitioners=_partitioners,
    embedding_recipes=("8w", "4w"),
)
