"""bench: what `genai bench` measures of an export on this machine (speed, memory, bandwidth).

text.py         a text program: prefill and decode speed, peak RSS, lookahead's acceptance
multimodal.py   a vision-language program: the image encoder, prefill and decode
"""

from genai_pipeline.bench.multimodal import bench_multimodal
from genai_pipeline.bench.text import bench

__all__ = ["bench", "bench_multimodal"]
