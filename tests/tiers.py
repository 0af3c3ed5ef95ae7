"""The full tier: tests that run only with `--full` (what `.ci/run` runs).

`python -m pytest -q -n auto tests` (the README's test command) is the quick tier: every module,
every kernel family on a few shapes on both sides of its route switches, whole-model greedy on the
demo, the API, the server and bad input. `python -m pytest -q -n auto tests --full` adds the tests
below and turns the emulator's race detector on for tests/kernels.

Each entry is a node-id pattern (fnmatch) and why the quick tier can do without it: what the quick
tier keeps that checks the same code. tests/conftest.py marks the matching tests `full` at
collection and deselects them unless `--full` is given ("N deselected" in pytest's summary, never a
skip). A pattern that matches no test of a collected file is an error, so the list cannot go stale.
Times are one run's CPU seconds on a 2-core CI-like machine without the race detector.
"""

FULL_TIER: dict[str, str] = {
    "tests/kernels/test_quantized_matmul.py::test_qmv1_shapes_and_splits[[]*one_split*": (
        "40,961 rows to cross kQmv1OneSplitGroups (21 s on emu); quick keeps every other qmv1 shape "
        "and test_qmv1_rows_rule_matches_extension, which checks the split rule at the switch"),
    "tests/model/test_kv_paging.py::test_greedy_equals_reference_past_several_blocks": (
        "90 greedy tokens over 5 KV blocks (9 s); quick keeps test_blocks_grow_straddle_and_match_the_reference "
        "(logits across block edges in prefill and decode) and tests/kernels/test_attention_paged.py"),
    # tests/model: whole-model runs on the emulator (most of the suite's time)
    "tests/model/test_engine_widths.py::test_engine_greedy_equals_reference[[]*-1-*": (
        "2/3/5/6-bit and mixed greedy after one-token prefill steps (10 runs, 90 s); quick keeps the "
        "64-token chunks on the M1-M4 path (every width's tiles, then 32 decode steps on the matvecs)"),
    "tests/model/test_engine_widths.py::test_engine_greedy_equals_reference[[]*-4096-*": (
        "the same prompt as one chunk (10 runs, 45 s); quick keeps the 64-token chunks"),
    "tests/model/test_engine_widths.py::test_engine_greedy_equals_reference[[]*-64-m5]": (
        "the M5 path at these widths (5 runs, 20 s): the same fp32 tiles as M1-M4 (quick), "
        "tests/kernels/test_quant_widths.py checks the routing with tensor ops"),
    "tests/model/test_engine.py::test_greedy_after_chunked_prefill[[]*": (
        "32 greedy tokens after chunks of 1 / 64 / 4096 on demo and real head dims (280 s); quick "
        "keeps test_demo_greedy_32_tokens_and_logits, test_chunked_prefill_equals_one_shot and "
        "test_greedy_generation_matches_reference"),
    "tests/model/test_engine.py::test_device_sampling_demo[[]temperature]": (
        "14 s; quick keeps the demo's filters route and every route on the small checkpoint "
        "(test_device_sampling_reproduces_reference)"),
    "tests/model/test_engine.py::test_device_sampling_demo[[]buckets]": "16 s; as above",
    "tests/model/test_engine_m5.py::test_greedy_after_chunked_prefill_on_the_m5_path[[]*": (
        "M5 path greedy after chunked prefill (275 s); quick keeps the M5 kernels' tests, "
        "test_real_config_prefill_4096_flops_with_tensor_ops and test_demo_greedy_on_the_m5_path[4096]"),
    "tests/model/test_engine_m5.py::test_greedy_on_the_int8_opt_in[[]*": (
        "int8 opt-in greedy (254 s); quick keeps tests/kernels/test_*_m5i8.py"),
    "tests/model/test_engine_m5.py::test_demo_greedy_on_the_m5_path[[]64]": (
        "47 s; quick keeps the 4096 chunk of the same test"),
    "tests/model/test_mixed_bits.py::test_long_prompt_in_chunks_on_both_matmul_paths[[]*-True]": (
        "the split route's M5 path on an 84-token prompt (8 s); quick keeps the simdgroup path of the "
        "same test and test_engine_greedy_equals_reference_on_the_m5_path (12-token chunks)"),
    "tests/model/test_bf16_activations.py::test_engine_bf16_error_no_larger_than_mlx_lm_bf16[[]*m1_m4]": (
        "bf16 error vs mlx-lm on the M1-M4 path (25 s); quick keeps the M5 path's four checkpoints "
        "(which share every non-matmul kernel)"),
    "tests/model/test_bf16_long_prompts.py::test_bf16_error_on_long_prompts_no_larger_than_mlx_lm[[]*": (
        "a 1,024-token prompt on the emulator (minutes); quick keeps "
        "test_fixture_is_this_checkpoint_and_reference and tests/model/test_bf16_activations.py"),
    "tests/model/test_bf16_long_prompts.py::test_committed_reference_rows[[]32768[]]": (
        "the NumPy reference on a 32,768-token prompt (75 s); quick keeps the 4,096-token rows"),
    "tests/model/test_bf16_long_prompts.py::test_committed_reference_rows[[]8192[]]": (
        "the NumPy reference on an 8,192-token prompt (10 s); quick keeps the 3,072- and 4,096-token rows"),
    "tests/model/test_bf16_activations.py::test_float32_option_keeps_the_fp32_path[[]bf16_*": (
        "three of four checkpoints (17 s); quick keeps std4_nested_fused"),
    # tests/kernels: real-size and long shapes (the quick tier keeps the odd small shapes)
    "tests/kernels/test_gated_delta_chunk_m5.py::test_m5_long_prompts_real_head_dims[[]*": (
        "4096 / 8192-token prompts at real head dims (44 s); quick keeps the small shapes and "
        "test_m5_continues_from_a_split_prompt"),
    "tests/kernels/test_gated_delta_chunk.py::test_long_prompts_real_head_dims[[]*": (
        "the same on the simdgroup route (9 s)"),
    "tests/kernels/test_moe_m5.py::test_m5_model_shapes": (
        "real expert shapes (22 s); quick keeps test_m5_tiles_sized_by_load at 11 odd sizes"),
    "tests/kernels/test_moe_m5.py::test_m5_model_shapes_small_experts": "18 s; as above",
    "tests/kernels/test_moe_bf16_tiles.py::test_bf16_tiles_real_shapes[[]*": (
        "real expert shapes (27 s); quick keeps test_bf16_tiles_odd_sizes"),
    "tests/kernels/test_moe_m5i8.py::test_int8_semantics_where_every_row_is_in_a_64_row_tile[[]model_*": (
        "H 2048 (14 s); quick keeps the H 192 / 256 cases"),
    "tests/kernels/test_sampling_kernels.py::test_top_p_tie_at_the_cutoff_keeps_lowest_ids[[]emu]": (
        "13 s on the emulator; quick keeps the same test on the reference sampler and the other "
        "tie tests"),
    "tests/api/test_structured.py::test_json_schema_answers_validate_20_seeds_of_20[[]*": (
        "the done-when run, 20 seeds per backend (about 9 min, mostly the emulator); quick keeps "
        "3 reference seeds and 1 emu seed of the same schema"),
    "tests/api/test_structured.py::test_forced_tool_calls_parse_20_seeds_of_20": (
        "the done-when run for forced tool calls, 20 seeds on the reference (80 s); quick keeps 2 "
        "reference seeds (required, named after thinking)"),
    "tests/api/test_structured.py::test_forced_tool_calls_parse_on_the_engine": (
        "4 of those seeds on the emulator (about 4 min); quick keeps test_json_schema_answers_validate[emu-*], "
        "the same masked sampling on the engine"),
    "tests/api/test_structured.py::test_forced_tool_call_on_the_engine": (
        "one short forced call on the emulator (about 90 s on 2 busy cores); quick keeps "
        "test_json_schema_answers_validate[emu-*], the same constrained path on the engine"),
    # tests/reference and tools
    "tests/reference/test_reference_model.py::test_full_size_shapes_in_bounded_memory": (
        "the real 35B shapes through the reference in bounded memory (28 s); quick keeps every "
        "reference equivalence on small configs"),
    "tests/api/test_sampling.py::test_sampled_frequencies_match_the_distribution[[]params[23]-*": (
        "two of four sampling-distribution checks (22 s); quick keeps params0 and params1"),
}
