"""The sha256 of the reference models' programs, exported the way `make demo` does: a refactor that
claims to change no behaviour leaves every line of this script's output as it was.

    python tools/program_digests.py [--out DIR] [RECIPE ...]     (default: fp32 8da4w 8da8w vlm)

"vlm" is reference-vlm's default export. GPTQ and the static recipes round on the host's CPU
kernels, so compare digests taken on the same machine.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
from pathlib import Path

import genai_pipeline as genai


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.pte"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", default=["fp32", "8da4w", "8da8w", "vlm"])
    parser.add_argument("--out", type=Path, help="keep the exports here (default: a temporary folder, removed)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="program-digests-"))
    try:
        for recipe in args.recipes:
            if recipe == "vlm":
                folder = genai.export("reference-vlm", out=root / "vlm")
            else:
                folder = genai.export("reference", out=root / recipe, quant=genai.QuantOptions(recipe=recipe))
            for name, digest in digests(folder.folder).items():
                print(f"{recipe:6} {name:24} {digest}", flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
