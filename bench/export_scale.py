"""What a default export costs as models grow: wall time, CPU time and peak RSS, whole and per stage.

For each shape, a Llama-format Hugging Face folder of random bf16 weights (std 0.02, norms ones, seeded)
is written to disk in ~2 GB safetensors shards, one shard in memory at a time (never the whole model),
with SmolLM2's real tokenizer (converted from the GGUF `make test` fetches; its 49,152 ids fall inside
every shape's vocabulary, so calibration and verification read text as for a real model). Then
`genai export --checkpoint FOLDER --recipe 8da4w` runs as a child under `/usr/bin/time -v`, and its
wall time, user + system CPU and peak RSS are recorded with the per-stage figures the export writes into
its manifest (`export_stages`, when the genai measured writes them), the program's bytes, the goal
of issue 40 (peak RSS <= 2.5 x the program's bytes + 2 GB) and the verification line. Results merge
per shape into a JSON; a chart draws peak RSS and minutes against parameters beside the peers'
published figures. GB and MB are binary (2^30, 2^20 bytes).

    .venv/bin/python -m bench.export_scale --shape tiny                  # a minute: the script works
    .venv/bin/python -m bench.export_scale --shape 1b --shape 3b --shape 8b --clean   # hours; a quiet host

Checkpoints are cached under --work (a shape's folder is reused once its done.json is written); the
export folder is deleted after it has been measured unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
import zlib
from pathlib import Path

from bench import png_chart
from bench.harness import (
    HERE,
    MAIN_PY,
    ROOT,
    ChildFailed,
    cached,
    genai_source,
    last_error_line,
    machine,
    run_child,
    say,
)

SMOLLM2_GGUF = ROOT / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # `make test` fetches it
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SHARD_BYTES = 2 << 30
TIME = Path("/usr/bin/time")  # Debian's `time` package: `apt-get install -y time`
GB = 2**30
MB = 2**20


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _shape(layers, dim, ffn, heads, kv_heads, vocab, tied, rope_factor) -> dict:
    return {
        "num_hidden_layers": layers,
        "hidden_size": dim,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": dim // heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "rope_theta": 500000.0,
        "rope_scaling": _llama3_rope(rope_factor),
    }


# Llama 3.x's public config.json sizes; `1b` keeps SmolLM2's vocabulary (issue 40's first measurement)
SHAPES = {
    "tiny": _shape(4, 256, 1024, 4, 2, 49152, True, 32.0),
    "small": _shape(4, 1024, 4096, 16, 4, 49152, True, 32.0),
    "1b": _shape(16, 2048, 8192, 32, 8, 49152, True, 32.0),  # Llama-3.2-1B with SmolLM2's vocabulary
    "3b": _shape(28, 3072, 8192, 24, 8, 128256, True, 32.0),  # Llama-3.2-3B
    "8b": _shape(32, 4096, 14336, 32, 8, 128256, False, 8.0),  # Llama-3.1-8B
}
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}

# The peers' published export costs, all for a Llama 3 8B (issue 40): label, source, peak RSS GB and minutes
# as (low, high), high None for "more than low". LiteRT-Torch's figure is quoted without a model: drawn at 8B.
PEERS_PARAMS_B = 8.03
PEERS = [
    ("ExecuTorch export_llm: >32 GB, killed", "pytorch/executorch#3850", (32, None), None),
    ("LiteRT-Torch: >=32 GB", "LiteRT-Torch's conversion requirements", (32, None), None),
    ("Qualcomm llama.py: 80-100 GB, 1-4 h", "Qualcomm's llama.py", (80, 100), (60, 240)),
]


# ----------------------------------------------------------------------------- the checkpoint


def tensor_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face LlamaForCausalLM's tensors, in its order; the head only when untied."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    tensors = [("model.embed_tokens.weight", (v, d))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (q, d)),
            (p + "self_attn.k_proj.weight", (kv, d)),
            (p + "self_attn.v_proj.weight", (kv, d)),
            (p + "self_attn.o_proj.weight", (d, q)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (f, d)),
            (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f)),
        ]
    tensors.append(("model.norm.weight", (d,)))
    if not config["tie_word_embeddings"]:
        tensors.append(("lm_head.weight", (v, d)))
    return tensors


def _bytes(shape: tuple[int, ...]) -> int:
    n = 2  # bf16
    for s in shape:
        n *= s
    return n


def plan_shards(tensors: list, shard_bytes: int) -> list[list]:
    """Consecutive tensors packed into shards of at most `shard_bytes` (a bigger tensor gets one of its own)."""
    shards, size = [[]], 0
    for name, shape in tensors:
        if shards[-1] and size + _bytes(shape) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += _bytes(shape)
    return shards


def random_tensor(name: str, shape: tuple[int, ...], seed: int):
    """bf16 N(0, 0.02) for a matrix, ones for a norm; seeded by the name, so a tensor does not depend on
    which shard it lands in."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed((seed << 32) + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)


def write_weights(folder: Path, config: dict, seed: int, shard_bytes: int = SHARD_BYTES) -> dict:
    """The sharded safetensors and model.safetensors.index.json of `config`'s random model: one shard in
    memory at a time."""
    from safetensors.torch import save_file

    tensors = tensor_shapes(config)
    shards = plan_shards(tensors, shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: random_tensor(name, shape, seed) for name, shape in shard}, folder / file, {"format": "pt"})
        weight_map.update({name: file for name, _ in shard})
    total = sum(_bytes(shape) for _, shape in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"parameters": total // 2, "bytes": total, "shards": len(shards)}


def write_tokenizer(folder: Path, gguf: Path) -> dict:
    """SmolLM2's tokenizer files, converted from its GGUF's metadata; its generation config's token ids."""
    from genai_pipeline.checkpoints import metadata_folder

    converted = metadata_folder(gguf)
    for name in TOKENIZER_FILES:
        shutil.copyfile(converted / name, folder / name)
    generation = json.loads((converted / "generation_config.json").read_text())
    return {"bos_token_id": generation["bos_token_id"], "eos_token_id": generation["eos_token_id"]}


def checkpoint(shape: str, work: Path, seed: int) -> dict:
    """The shape's folder under `work`, written unless its done.json says it is there."""
    folder = work / f"{shape}-seed{seed}" / "checkpoint"
    done = folder / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("config") != SHAPES[shape]:
        done.unlink()  # written for another definition of the shape

    def make() -> dict:
        if not SMOLLM2_GGUF.is_file():
            sys.exit(f"SmolLM2's GGUF (the tokenizer) is missing: {SMOLLM2_GGUF}; `make test` fetches it")
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted write
        folder.mkdir(parents=True)
        say(f"{shape}: writing random bf16 weights to {folder}")
        start = time.perf_counter()
        config = {**COMMON, **SHAPES[shape], **write_tokenizer(folder, SMOLLM2_GGUF)}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written = write_weights(folder, config, seed)
        return {
            "folder": str(folder),
            "seed": seed,
            "config": SHAPES[shape],
            **written,
            "write_s": round(time.perf_counter() - start, 1),
        }

    return cached(done, make)


# ----------------------------------------------------------------------------- the export


def time_v(path: Path) -> dict:
    """`/usr/bin/time -v`'s report as {field: text}."""
    fields = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().rpartition(": ")
        if sep:
            fields[key] = value
    return fields


def export(shape: str, model: dict, work: Path, src: dict, keep: bool) -> dict:
    """One default export of the shape's folder, measured."""
    run = work / f"{shape}-seed{model['seed']}"
    out = run / "export"
    shutil.rmtree(out, ignore_errors=True)  # a previous export's calibrated model would be reused
    argv = [MAIN_PY, "-m", "genai_pipeline.cli", "export", "--checkpoint", model["folder"], "--recipe", "8da4w"]
    argv += ["--out", out]
    timed = TIME.is_file()
    if timed:
        argv = [TIME, "-v", "-o", run / "time.txt", *argv]
    say(f"{shape}: genai export (log: {run / 'export.log'})")
    load = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # The export's QDQ cache entry (its chosen int4 values: 1.4 GB for the 3B shape) goes with the export
    cache = run / "qdq-cache"
    env = {**src["env"], "GENAI_PIPELINE_CACHE": str(cache)}
    wall, peak_mb, _ = run_child(argv, log=run / "export.log", cwd=src["cwd"], env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    record = {"measured_by": "/usr/bin/time -v" if timed else "os.wait4 and RUSAGE_CHILDREN"}
    if timed:
        report = time_v(run / "time.txt")
        cpu_s = float(report["User time (seconds)"]) + float(report["System time (seconds)"])
        peak_mb = int(report["Maximum resident set size (kbytes)"]) / 1024
        record["major_page_faults"] = int(report["Major (requiring I/O) page faults"])
        record["cpu_percent"] = report["Percent of CPU this job got"]
    manifest = json.loads((out / "manifest.json").read_text())
    program = (out / "text_decoder.pte").stat().st_size
    bound_mb = (2.5 * program + 2 * GB) / MB
    verification = manifest.get("verification")
    stages = manifest.get("export_stages")
    if not keep:
        shutil.rmtree(out)
        shutil.rmtree(cache, ignore_errors=True)
    return {
        **record,
        "shape": shape,
        "config": SHAPES[shape],
        "parameters": model["parameters"],
        "parameters_b": round(model["parameters"] / 1e9, 3),
        "checkpoint_gb": round(model["bytes"] / GB, 2),
        "genai": src["sha"],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(wall, 1),
        "minutes": round(wall / 60, 2),
        "cpu_s": round(cpu_s, 1),
        "peak_rss_mb": round(peak_mb),
        "program_bytes": program,
        "bound_mb": round(bound_mb),
        "within_bound": peak_mb <= bound_mb,
        "verification": verification,
        "verification_line": verification_line(verification),
        "stages": stages["stages"] if stages else None,
        "stages_peak_rss_mb": stages["peak_rss_mb"] if stages else None,
        "loadavg_start": load,
        "loadavg_end": os.getloadavg(),
    }


def verification_line(v: dict | None) -> str:
    """genai's own line (evaluate/verify.py's Verification.line) from the manifest's figures."""
    if not v:
        return "not verified"
    return (
        f"verified on {v['tokens']} tokens of {v['text']}: perplexity {v['perplexity_float']:.2f} -> "
        f"{v['perplexity_program']:.2f} ({100 * v['perplexity_change']:+.1f} %), top-1 agreement "
        f"{100 * v['top1_agreement']:.1f} %, KL {v['kl_divergence']:.4f}"
    )


def summary(r: dict) -> str:
    met = "met" if r["within_bound"] else "exceeded"
    return (
        f"{r['shape']}: {r['parameters_b']:.2f} B parameters, {r['minutes']:.1f} min wall, {r['cpu_s']:.0f} s CPU, "
        f"peak RSS {r['peak_rss_mb'] / 1024:.2f} GB; program {r['program_bytes'] / MB:.0f} MB, "
        f"goal <= {r['bound_mb'] / 1024:.2f} GB: {met}"
    )


def stage_table(r: dict) -> str:
    if not r["stages"]:
        return "  (no export_stages in the manifest: this genai does not record its stages)"
    w = max(14, *(len(s["name"]) + 2 for s in r["stages"]))
    rows = [f"  {'stage':<{w}}{'seconds':>10}{'cpu s':>10}{'peak RSS MB':>13}"]
    for s in r["stages"]:
        rows.append(f"  {s['name']:<{w}}{s['seconds']:>10.1f}{s['cpu_seconds']:>10.1f}{s['peak_rss_mb']:>13.0f}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- the chart


def chart(records: list[dict], w: int = 1200, h: int = 480) -> bytes:
    """Peak RSS (GB) and minutes against parameters (billions): ours, labelled by shape, beside the peers."""
    img = png_chart.canvas(w, h)
    rss = [(r["parameters_b"], r["peak_rss_mb"] / 1024, r["shape"]) for r in records]
    minutes = [(r["parameters_b"], r["minutes"], r["shape"]) for r in records]
    peer_rss = [(PEERS_PARAMS_B, rss_gb, label) for label, _, rss_gb, _ in PEERS]
    peer_minutes = [(PEERS_PARAMS_B, minutes, label) for label, _, _, minutes in PEERS if minutes]
    for box, title, ours, peers in (
        ((70, 40, w // 2 - 30, h - 70), "export peak RSS GB", rss, peer_rss),
        ((w // 2 + 60, 40, w - 30, h - 70), "export minutes", minutes, peer_minutes),
    ):
        y_top = max([y for _, y, _ in ours] + [high or low for _, (low, high), _ in peers])
        png_chart.panel(img, box, title, "parameters B", 9, y_top, ours, peers)
    png_chart.text(img, 70, h - 18, "blue: genai export --recipe 8da4w (this host)   red: published", png_chart.BLACK)
    return png_chart.png(img)


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.export_scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="repeatable (default: tiny)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/export_scale"), help="checkpoints and exports")
    parser.add_argument("--out-json", type=Path, default=HERE / "results" / "export_scale.json")
    parser.add_argument("--chart", type=Path, default=HERE / "results" / "export_scale.png")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights")
    parser.add_argument("--genai-ref", default="HEAD", help="git ref whose genai_pipeline/ exports, or 'worktree'")
    parser.add_argument("--keep", action="store_true", help="keep each export folder (under --work)")
    parser.add_argument("--clean", action="store_true", help="delete each shape's checkpoint once it is measured")
    args = parser.parse_args()
    os.environ.pop("GENAI_DEBUG", None)  # its extra checks are not the export's cost
    if not TIME.is_file():
        say(f"{TIME} is missing (apt-get install -y time): peak RSS from os.wait4, CPU from RUSAGE_CHILDREN")
    args.work.mkdir(parents=True, exist_ok=True)
    src = genai_source(args.genai_ref, args.work)
    host = machine()
    host = {k: host[k] for k in ("cpu_model", "cpus", "platform", "amx", "avx512")}
    results = json.loads(args.out_json.read_text()) if args.out_json.is_file() else {"runs": {}}
    for shape in args.shape or ["tiny"]:
        model = checkpoint(shape, args.work, args.seed)
        try:
            record = {**export(shape, model, args.work, src, args.keep), "machine": host}
        except ChildFailed as e:
            sys.exit(
                f"{shape}: the export failed: {last_error_line(e)} (log: {args.work}/{shape}-seed{args.seed}/export.log)"
            )
        if args.clean:
            shutil.rmtree(model["folder"])  # the export (--keep) and its log stay
        results["runs"][shape] = record
        results["peers"] = [  # what the chart draws beside ours
            {"label": label, "source": source, "params_b": PEERS_PARAMS_B, "rss_gb": rss_gb, "minutes": minutes}
            for label, source, rss_gb, minutes in PEERS
        ]
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(results, indent=2) + "\n")
        print(summary(record))
        print("  " + record["verification_line"])
        print(stage_table(record))
    args.chart.parent.mkdir(parents=True, exist_ok=True)
    runs = sorted(results["runs"].values(), key=lambda r: r["parameters"])
    args.chart.write_bytes(chart(runs))
    print(f"wrote {args.out_json} and {args.chart} ({host['cpu_model']}, {host['cpus']} cores)")


if __name__ == "__main__":
    main()
