"""stages.py: what an export's stages record (child processes: a peak is a process's own)."""

import json
import subprocess
import sys

SPIKE = r"""
import json
from genai_pipeline.stages import recording, rss_mb, stage

with recording() as rec:
    with stage("steady", quiet=True):
        pass
    with stage("spike", quiet=True):
        # 400 MB written and freed inside one call holding the GIL: no sample of the thread sees it
        len(b"\x01" * (400 << 20))
print(json.dumps({"base": rss_mb(), **{s.name: s.peak_rss_mb for s in rec.stages.values()}}))
"""


def test_a_stage_shows_a_peak_it_set_between_two_samples():
    out = subprocess.run([sys.executable, "-c", SPIKE], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["spike"] > got["base"] + 380  # the process's record, which the stage set
    assert got["steady"] < got["base"] + 100
