"""Exact-match accuracy of an exported vision-language program on image questions.

Runs the program through `genai_pipeline.runtime` -- the code `genai run DIR --image IMG --prompt Q`
uses (MultimodalSession, the same prompt expansion, greedy decoding, up to `--max-new-tokens`) --
over a jsonl of `{"image", "prompt", "answer"}` (image paths relative to the jsonl; an optional
`kind` is reported separately) and compares the stripped answer with the expected one.

    .venv/bin/python -m bench.vlm_exact_match out/reference-vlm [--data assets/reference-vlm/heldout.jsonl] [--json]

`--executorch-runner N` also answers the first N questions with ExecuTorch's own MultimodalRunner
(C++ tokenizer and generation loop; the same prompt ids, the image as an image input) and reports
its exact match and how many of its answers equal ours.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as genai run (docs/decisions/0002: ExecuTorch's SDPA and OpenMP)

import argparse
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "assets" / "reference-vlm" / "heldout.jsonl"


def measure(folder: Path, data: Path, limit: int = 0, max_new_tokens: int = 16) -> dict:
    from genai_pipeline.options import SamplingOptions
    from genai_pipeline.runtime.generate import Sampler, generate
    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    session = MultimodalSession(folder, verify=True)
    tokenizer = Tokenizer.from_folder(folder, bos_id=session.manifest.get("bos_id"))
    eos = tuple(session.manifest.get("eos_ids", ()))
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    hits, per_kind, wrong, start = 0, {}, [], time.perf_counter()
    for row in rows:
        session.reset()
        prompt = session.encode_prompt(tokenizer, row["prompt"], [data.parent / row["image"]])
        result = generate(
            session, prompt, max_new_tokens, Sampler(SamplingOptions(temperature=0.0)), eos, lambda t: None
        )
        answer = tokenizer.decode(result.tokens).strip()
        ok = answer == row["answer"]
        hits += ok
        kind = per_kind.setdefault(row.get("kind", "all"), [0, 0])
        kind[0] += ok
        kind[1] += 1
        if not ok:
            wrong.append({"image": row["image"], "prompt": row["prompt"], "answer": row["answer"], "got": answer})
    return {
        "program": str(folder),
        "data": str(data),
        "n": len(rows),
        "exact_match": round(hits / len(rows), 4),
        "per_kind": {k: round(a / b, 4) for k, (a, b) in sorted(per_kind.items())},
        "seconds": round(time.perf_counter() - start, 1),
        "wrong": wrong,
    }


def executorch_runner(folder: Path, data: Path, limit: int, max_new_tokens: int = 16) -> dict:
    """The first `limit` questions through `executorch.extension.llm.runner.MultimodalRunner`."""
    import numpy as np
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_image_input, make_token_input

    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    session = MultimodalSession(folder)
    tokenizer = Tokenizer.from_folder(folder, bos_id=session.manifest.get("bos_id"))
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(str(folder / "tokenizer.json"))  # the runner prints EOS as its text
    eos_text = [vocab.id_to_token(e) for e in session.manifest.get("eos_ids", ())]
    runner = MultimodalRunner(str(folder / "multimodal.pte"), str(folder / "tokenizer.json"))
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()][:limit]
    answers, hits = [], 0
    for row in rows:
        ids = session.encode_prompt(tokenizer, row["prompt"], [data.parent / row["image"]])
        (frame,) = session.frames
        image = session.image_token_id
        first, last = ids.index(image), len(ids) - ids[::-1].index(image)
        inputs = [
            make_token_input(ids[:first]),
            make_image_input(__import__("torch").from_numpy(np.ascontiguousarray(frame))),
            make_token_input(ids[last:]),
        ]
        pieces = []
        runner.reset()  # else the KV cache keeps every earlier question: the runner continues a conversation
        runner.generate(
            inputs,
            GenerationConfig(echo=False, max_new_tokens=max_new_tokens, temperature=0.0),
            token_callback=pieces.append,
        )
        text = "".join(pieces)
        for e in eos_text:
            text = text.split(e)[0] if e else text
        answers.append(text.strip())
        hits += text.strip() == row["answer"]
    return {"n": len(rows), "exact_match": round(hits / len(rows), 4), "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vlm_exact_match", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="an exported vision-language model (genai export --out DIR)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--limit", type=int, default=0, help="first N questions only (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--executorch-runner",
        type=int,
        default=0,
        metavar="N",
        help="also answer the first N questions with ExecuTorch's MultimodalRunner",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.folder, args.data, args.limit, args.max_new_tokens)
    if args.executorch_runner:
        et = executorch_runner(args.folder, args.data, args.executorch_runner, args.max_new_tokens)
        rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()][: et["n"]]
        wrong = {(w["image"], w["prompt"]): w["got"] for w in result["wrong"]}
        ours = [wrong.get((r["image"], r["prompt"]), r["answer"]) for r in rows]
        et["same_as_ours"] = sum(a == b for a, b in zip(et["answers"], ours))
        result["executorch_runner"] = et
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{result['program']}: exact match {100 * result['exact_match']:.1f} % of {result['n']} ({result['seconds']} s)"
    )
    for kind, acc in result["per_kind"].items():
        print(f"  {kind:10s} {100 * acc:.1f} %")
    if "executorch_runner" in result:
        et = result["executorch_runner"]
        print(
            f"ExecuTorch MultimodalRunner, first {et['n']}: exact match {100 * et['exact_match']:.1f} %, "
            f"{et['same_as_ours']} of {et['n']} answers equal ours"
        )
    for w in result["wrong"][:10]:
        print(f"  wrong: {w['image']} {w['prompt']!r} expected {w['answer']!r}, got {w['got']!r}")


if __name__ == "__main__":
    main()
