"""The report's choices on rows made by hand: the Pareto front, the size classes, the recommendations."""

from genai_pipeline.sweep.report import (
    ANSWERS,
    PERPLEXITY,
    accuracy_of,
    pareto,
    recommendations,
    render,
    size_classes,
)
from genai_pipeline.sweep.spec import Report


def row(variant, mb, change, speed=100.0, status="done"):
    return {
        "task": f"m--{variant}",
        "model": "m",
        "variant": variant,
        "status": status,
        "program_mb": mb,
        "perplexity_change_pct": change,
        "decode_tokens_per_s": speed,
    }


ROWS = [row("fp32", 540, 0.0, 90), row("8da8w", 170, 0.4, 200), row("8da4w", 92, 5.2, 270), row("mix", 180, 0.9, 190)]


def test_the_pareto_front_is_what_no_row_beats_on_both_size_and_perplexity():
    assert pareto(ROWS) == {"m--fp32", "m--8da8w", "m--8da4w"}  # `mix` is larger and worse than 8da8w
    assert pareto([*ROWS, row("broken", 1, -9, status="failed")]) == pareto(ROWS)


def test_size_classes_step_1_2_5_over_the_sizes_unless_the_spec_names_them():
    assert size_classes(ROWS, Report()) == (100, 200, 500, 1000)
    assert size_classes(ROWS, Report(size_classes_mb=(200, 100))) == (100, 200)


def test_a_recommendation_per_size_class():
    lines = recommendations(ROWS, Report(max_perplexity_change=1, size_classes_mb=(50, 100, 200)))
    assert lines == [
        "smallest program within +1 % perplexity: 8da8w (170.0 MB, +0.40 %, 200.0 tok/s decode)",
        "up to 50 MB: none fits",
        "up to 100 MB: lowest perplexity change: 8da4w (92.0 MB, +5.20 %, 270.0 tok/s decode)",
        "up to 200 MB: lowest perplexity change: 8da8w (170.0 MB, +0.40 %, 200.0 tok/s decode)",
    ]
    assert recommendations([row("x", 1, 0, status="failed")], Report()) == ["no task finished: nothing to recommend"]


def test_the_chart_colours_points_by_decode_speed():
    full = [
        {**r, "recipe": "r", "mode": "kv", "perplexity": 20.0, "kl_divergence": 0.01, "top1_agreement": 0.9}
        | {"prefill_tokens_per_s": 1.0, "peak_rss_mb": 1.0, "export_minutes": 1.0, "export_peak_rss_mb": 1.0}
        for r in ROWS
    ]
    machine = {"cpu": "AMD EPYC (family 25, model 17)", "vector": "avx512f", "cores": 2, "threads": 2, "host": "vm"}
    page = render(
        {"spec": "s.yaml", "rows": full, "ran": 4, "skipped": 0, "seconds": 60, "machines": [machine]}, Report()
    )
    assert "#440154" in page and "#fde725" in page  # the slowest (fp32) and the fastest (8da4w) ends of the ramp
    assert (
        page.count("class=pareto") == 3
        and "AMD EPYC (family 25, model 17) (avx512f), 2 threads on 2 cores (vm)" in page
    )


def vlm_row(variant, mb, answer_change, exact, text_change):
    """A vision-language model's row: judged by its answers to the image questions."""
    r = row(variant, mb, text_change, 3000.0) | {"task": f"v--{variant}", "model": "v"}
    return r | {"answer_perplexity_change_pct": answer_change, "exact_match": exact, "float_exact_match": 0.9}


# by its text perplexity 8da4w would beat 8da8w; by its answers (tower and decoder) it does not
VLM_ROWS = [
    vlm_row("fp32", 20, 0.0, 0.9, 0.0),
    vlm_row("8da8w", 5.3, 0.01, 0.92, 1.2),
    vlm_row("8da4w", 4.0, 0.8, 0.88, 0.5),
]


def test_a_vision_language_model_is_judged_by_its_answers_beside_a_text_model():
    assert accuracy_of(VLM_ROWS) is ANSWERS and accuracy_of(ROWS) is PERPLEXITY
    assert pareto(VLM_ROWS, ANSWERS) == {"v--fp32", "v--8da8w", "v--8da4w"}
    assert recommendations(VLM_ROWS, Report(max_perplexity_change=0.5, size_classes_mb=(5,)), ANSWERS) == [
        "smallest program within +0.5 % answer perplexity: 8da8w (5.3 MB, +0.010 %, exact match 92.0 % "
        "(float 90.0 %), 3000.0 tok/s decode)",
        "up to 5 MB: lowest answer perplexity change: 8da4w (4.0 MB, +0.800 %, exact match 88.0 % (float 90.0 %), "
        "3000.0 tok/s decode)",
    ]
    # a text model and a vision-language one in one sweep: a section each, each by its own accuracy
    full = [
        r
        | {"recipe": "r", "mode": "kv", "perplexity": 20.0, "kl_divergence": 0.01, "top1_agreement": 0.9}
        | {"prefill_tokens_per_s": 1.0, "peak_rss_mb": 1.0, "export_minutes": 1.0, "export_peak_rss_mb": 1.0}
        | ({"answer_perplexity": 1.07, "answers_agree": 0.97, "image_encode_ms": 0.8} if r["model"] == "v" else {})
        for r in ROWS + [VLM_ROWS[0], VLM_ROWS[2] | {"perplexity_change_pct": None}]
    ]
    page = render({"spec": "s.yaml", "rows": full, "ran": 6, "skipped": 0, "seconds": 60, "machines": []}, Report())
    text, vlm = page.split("<h2>")[1:]
    assert "perplexity change (%)</text>" in text and "<th>top-1 %" in text and "answer" not in text
    assert "answer perplexity change (%)</text>" in vlm and "<th>exact match %<th>= float %" in vlm
    assert "<td class=num>90.0 (float 90.0)" in vlm and "<td class=num>n/a" in vlm  # 8da4w: no text scored
    assert "smallest program within +5 % answer perplexity: 8da4w (4.0 MB, +0.800 %" in vlm
    assert "Answer perplexity change (a vision-language model" in page
