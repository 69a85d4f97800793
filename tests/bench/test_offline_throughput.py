"""The offline benchmark end to end on a tiny random model: the table, the JSON, the A/B variants."""

from __future__ import annotations

import json

import pytest

from treadle.bench.offline_throughput import main, parse_variants
from treadle.bench.workloads import parse_len_range, random_workload, shared_prefix_workload


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama_text_dir) -> str:
    return tiny_llama_text_dir


def run_bench(tmp_path, model_dir: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    code = main([
        "--num-prompts", "6", "--prefix-len", "48", "--question-len", "4:8", "--input-len", "8:40",
        "--output-len", "3:6", "--warmup-prompts", "2", "--no-progress",
        "--set", f"model.path={model_dir}", "--set", "cache.max_total_tokens=2048",
        "--output", str(out), *args,
    ])
    assert code == 0
    return json.loads(out.read_text())


def test_compare_hf_reports_both_systems_and_their_ratio(tmp_path, tiny_model_dir, capsys):
    report = run_bench(tmp_path, tiny_model_dir, "--workload", "random", "--compare", "hf", "--hf-batch-size", "4")

    assert report["command"].startswith("treadle bench offline ")
    assert report["machine"]["cpu_count"] >= 1 and report["date"]
    workload = report["workload"]
    assert workload["name"] == "random" and workload["num_requests"] == 6
    treadle, hf = report["systems"]
    assert (treadle["kind"], hf["kind"]) == ("treadle", "hf")
    for system in (treadle, hf):
        assert system["output_tokens"] == workload["output_tokens"]
        assert system["total_time_s"] > 0
        assert system["output_throughput_tok_s"] == pytest.approx(system["output_tokens"] / system["total_time_s"])
        assert system["request_throughput_req_s"] == pytest.approx(6 / system["total_time_s"])
    assert treadle["config"]["model"]["path"] == tiny_model_dir
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert treadle["ratio_vs_hf"] == pytest.approx(
        treadle["output_throughput_tok_s"] / hf["output_throughput_tok_s"])
    assert report["ratios"]["vs_hf"]["treadle"] == treadle["ratio_vs_hf"]
    table = capsys.readouterr().out
    assert "out tok/s" in table and "vs hf" in table and "peak bs" in table
    # The StepMeter saw every step; the batch never exceeds the resolved running limit (64 on the CPU).
    extra = treadle["extra"]
    assert extra["max_running_requests"] == 64 and extra["enable_mixed_chunk"] is False
    assert 1 <= extra["peak_decode_batch_size"] <= 6 and extra["steps"] > extra["decode_steps"] > 0
    assert "decode_graph_batch_sizes" not in extra  # no CUDA graphs on the CPU


def test_radix_ab_variants_run_in_order_and_only_radix_reuses_the_prefix(tmp_path, tiny_model_dir, capsys):
    # Two at a time, so later requests are admitted after earlier ones finished and cached the prefix.
    report = run_bench(tmp_path, tiny_model_dir, "--workload", "shared-prefix",
                       "--set", "scheduler.max_running_requests=2",
                       "--compare", "cache.disable_radix_cache=false,cache.disable_radix_cache=true")

    radix, no_radix = report["systems"]
    assert radix["config"]["cache"]["disable_radix_cache"] is False
    assert no_radix["config"]["cache"]["disable_radix_cache"] is True
    # The first two miss (the warm-up's cache was flushed); the four admitted later find the 48-token prefix.
    assert radix["extra"]["cached_prompt_tokens"] >= 4 * 48
    assert no_radix["extra"]["cached_prompt_tokens"] == 0
    assert radix["ratio_vs_first"] == 1.0
    assert report["ratios"]["vs_hf"] is None
    assert "cache.disable_radix_cache=true" in capsys.readouterr().out


def test_profile_steps_profile_a_saturated_stretch(tmp_path, tiny_model_dir):
    report = run_bench(tmp_path, tiny_model_dir, "--profile-steps", "2")
    profile = report["systems"][0]["extra"]["profile"]
    assert profile["torch"]["steps"] == 2 and profile["cprofile"]["steps"] == 2
    assert all(mode == "DECODE" for mode, _ in profile["torch"]["batches"])
    assert profile["cprofile"]["top_cumulative"][0]["cum_us_per_step"] > 0


def test_parse_variants_accepts_override_sets_hf_and_backend_shorthand():
    variants, with_hf = parse_variants("hf,scheduler.policy=lpm;cache.page_size=1", None)
    assert with_hf and [v.overrides for v in variants] == [["scheduler.policy=lpm", "cache.page_size=1"]]
    variants, with_hf = parse_variants("hf", "torch_native,triton")
    assert with_hf and [v.overrides for v in variants] == [["attention.backend=torch_native"],
                                                           ["attention.backend=triton"]]
    assert parse_variants(None, None)[0][0].overrides == []
    with pytest.raises(ValueError, match="section.key=value"):
        parse_variants("lpm", None)


def test_workloads_are_reproducible_and_shaped_as_asked():
    ids = list(range(10, 100))
    first = random_workload(20, ids, input_len=(5, 9), output_len=(2, 4), seed=3)
    assert first.requests == random_workload(20, ids, input_len=(5, 9), output_len=(2, 4), seed=3).requests
    assert all(5 <= len(r.input_ids) <= 9 and 2 <= r.output_len <= 4 for r in first.requests)
    shared = shared_prefix_workload(8, ids, prefix_len=30, question_len=(3, 5), num_prefixes=2)
    prefixes = {tuple(r.input_ids[:30]) for r in shared.requests}
    assert len(prefixes) == 2
    assert all(33 <= len(r.input_ids) <= 35 for r in shared.requests)
    assert parse_len_range("16:64") == (16, 64) and parse_len_range("7") == (7, 7)
    with pytest.raises(ValueError, match="MIN:MAX"):
        parse_len_range("a:b")


def test_baseline_adds_the_ratio_to_an_earlier_run(tmp_path, tiny_model_dir, capsys):
    earlier = run_bench(tmp_path / "earlier", tiny_model_dir, "--workload", "random")
    report = run_bench(tmp_path, tiny_model_dir, "--workload", "random",
                       "--baseline", str(tmp_path / "earlier" / "result.json"))
    system = report["systems"][0]
    assert system["ratio_vs_baseline"] == pytest.approx(
        system["output_throughput_tok_s"] / earlier["systems"][0]["output_throughput_tok_s"])
    assert "vs baseline" in capsys.readouterr().out


def test_json_schema_ab_runs_both_at_equal_token_counts(tmp_path, tiny_model_dir):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}}, "required": ["n"]}))
    report = run_bench(tmp_path, tiny_model_dir, "--output-len", "4:40", "--json-schema", str(schema))

    free, constrained = report["systems"]
    assert (free["name"], constrained["name"]) == ("treadle", "treadle +json-schema")
    # '{"n": 7}' and EOS end a request before 40 tokens; the unconstrained run generates as many.
    lengths = constrained["extra"]["completion_tokens"]
    assert max(lengths) < 40 and free["output_tokens"] == constrained["output_tokens"] == sum(lengths)
    assert constrained["ratio_vs_first"] == pytest.approx(
        constrained["output_throughput_tok_s"] / free["output_throughput_tok_s"])


def test_speculative_runs_report_the_acceptance_length(tmp_path, tiny_model_dir, capsys):
    # Outputs long enough for the tiny model to repeat itself, so the n-gram look-up finds something to verify.
    report = run_bench(tmp_path, tiny_model_dir, "--workload", "random", "--output-len", "24:32",
                       "--set", "plugins=[treadle.plugins.speculators.ngram]", "--set", "speculative.method=ngram",
                       "--set", "speculative.max_batch_size=8")
    (system,) = report["systems"]
    assert system["extra"]["spec_acceptance_length"] >= 1.0
    out = capsys.readouterr().out
    assert "accept len" in out and "acceptance length" in out
