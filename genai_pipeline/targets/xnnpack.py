"""XNNPACK: ExecuTorch's CPU delegate (x86 and Arm). Delegated weights are stored as named data
keyed by content, so the methods of one program share a single copy."""

import copy
import ctypes
import mmap
import sys

from genai_pipeline.targets import Target

_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None


def _copy_sharing_weights(cls, program, compile_specs):
    """The hook ExecuTorch calls to isolate each partition before `preprocess`, minus the weights.
    Its default deep-copies the partition's weights too, and holds the copies of every partition
    of every method at once: two extra copies of a hybrid program's weights. XNNPACK's preprocess
    replaces constants, never writes into them, so sharing them is safe."""
    weights = (*program.state_dict.values(), *program.constants.values())
    return copy.deepcopy(program, memo={id(w): w for w in weights})


def _page_out(tensors) -> None:
    """Hint the kernel to reclaim the pages behind `tensors` that are memory-mapped files (Linux
    MADV_PAGEOUT). Checkpoint weights are read from mapped safetensors files: once a partition's
    weights are serialized, their pages are clean copies of the file and can go, to be read again
    only if something reads them again. Anonymous memory (e.g. quantized weights) is left alone."""
    if _madvise is None:
        return
    with open("/proc/self/maps") as maps:  # [start, end) of every file mapping: lines with an inode
        files = [tuple(int(a, 16) for a in f[0].split("-")) for f in map(str.split, maps) if len(f) >= 6 and f[4] != "0"]
    page = mmap.PAGESIZE
    for t in tensors:
        start, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
        if last > first and any(lo <= first and last <= hi for lo, hi in files):
            _madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 21)  # 21: MADV_PAGEOUT


def _preprocess_sharing_data(cls, programs, compile_specs):
    """ExecuTorch's default `preprocess_multimethod`, holding one bytes object per named weight:
    each method serializes its partitions on its own, so every weight the methods share would
    otherwise sit in memory once per method until the program is written. XNNPACK names weights
    by the SHA-256 of their bytes, so one name is one content."""
    results, by_name = {}, {}
    for method, partitions in programs.items():
        results[method] = []
        for partition, specs in zip(partitions, compile_specs[method]):
            result = cls.preprocess(partition, specs)
            _page_out(partition.state_dict.values())
            store = result.data_store_output  # deduplicated now, before the next partition adds its own
            for name, entry in (store.pte_data if store is not None else {}).items():
                store.buffers[entry.buffer_index] = by_name.setdefault(name, store.buffers[entry.buffer_index])
            results[method].append(result)
    return results


def _partitioners() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    # Both are hooks ExecuTorch gives backends to override; these keep lowering within ~2x the weights.
    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(_copy_sharing_weights)
    XnnpackBackend.preprocess_multimethod = classmethod(_preprocess_sharing_data)
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


def _adapt_for_lowering(module) -> None:
    from genai_pipeline.models.decoder import RMSNorm

    for norm in module.modules():
        if isinstance(norm, RMSNorm):
            norm.mean_by_matmul()


TARGET = Target(
    name="xnnpack",
    description="CPU via the XNNPACK delegate",
    recipes=("fp32", "8da4w", "8da8w", "8a8w"),
    partitioners=_partitioners,
    embedding_recipes=("8w", "4w"),
    static_quantizer=_static_quantizer,
    adapt_for_lowering=_adapt_for_lowering,
)
