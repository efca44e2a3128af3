"""XNNPACK: ExecuTorch's CPU delegate (x86 and Arm). Delegated weights are stored as named data
keyed by content, so the methods of one program share a single copy."""

from genai_pipeline.targets import Target


def _partitioners() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


def _static_quantizer(options, graph_module):
    """8a8w: static per-tensor int8 activations, per-channel int8 weights (symmetric)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    # The LM head sees the widest activation range of the model: one static scale for it costs
    # the most perplexity, so it quantizes its input per token at run time instead.
    dynamic = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
    return quantizer.set_module_name("decoder.output", dynamic)


TARGET = Target(
    name="xnnpack",
    description="CPU via the XNNPACK delegate",
    recipes=("fp32", "8da4w", "8da8w", "8a8w"),
    partitioners=_partitioners,
    embedding_recipes=("8w", "4w"),
    static_quantizer=_static_quantizer,
)
