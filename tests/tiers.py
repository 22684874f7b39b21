"""The slow tier: tests that run only with ``pytest -m slow`` (the default run, the README's test command, deselects
them through pyproject's ``-m "not slow"``; .ci/run runs both tiers).

Each entry names a test module, a test (every parametrisation) or one parametrisation, with the property it proves
and the default-tier test that keeps that property proven on every run. A test moves here when it costs many
seconds and repeats a property the default tier already holds on another drafter, tree, family or shape; a
property with no representative left would be a hole, so every entry names one. A renamed test that no longer
matches its entry runs in the default tier: the safe direction.
"""

from __future__ import annotations

SLOW: dict[str, str] = {
    # --- meshes -------------------------------------------------------------------------------------------------
    "tests/jspec/test_sharded_engine.py":
        "every drafter's greedy and seeded tokens at tp 8 and dp 2 x tp 4 equal one device's, one all-reduce per "
        "layer and no weight gather in the loop; default: test_multihost's tp 4 engine over two processes (= one "
        "device), test_sharded_kernels and test_sharded_params on 4 devices",
    "tests/jspec/test_multihost.py::test_cli_multihost_only_process_0_prints":
        "the CLI on two processes prints once and decides auto on process 0's cache; default: "
        "test_two_processes_tp4_equal_one_device",
    "tests/jspec/test_capture_hidden_states.py::test_capture_on_a_mesh_equals_one_device":
        "hidden-state capture on a mesh; default: capture on one device, and the sharded engine cases",
    # --- serving ------------------------------------------------------------------------------------------------
    "tests/jspec/serve/test_app.py::test_32_concurrent_greedy_requests_equal_generate_alone_and_the_scheduler_compiles_nothing":
        "32 concurrent greedy requests each equal offline generate, the scheduler compiles nothing; default: "
        "test_completion_stream_equals_whole_with_usage (a served request equals offline), test_slots",
    "tests/jspec/serve/test_app.py::test_sampled_request_alone_equals_it_among_15_others":
        "a seeded sampled request's tokens do not depend on its neighbours; default: test_per_request_seeds, "
        "test_slots",
    "tests/jspec/serve/test_app.py::test_n_choices_with_a_seed_each_equal_a_single_request_with_its_seed":
        "n sampled choices each equal a request with its derived seed (on the 16-slot server without load "
        "adaptation); default: test_best_of_keeps_the_most_likely_choices (n and best_of through the client)",
    "tests/jspec/serve/test_app.py::test_a_full_queue_answers_503_with_retry_after":
        "a full queue answers 503 with Retry-After; default: the other 503 tests (warm-up, shutdown)",
    "tests/jspec/serve/test_serve_process.py::test_serve_answers_then_drains_on_sigterm":
        "a real `jspec serve` process answers and drains on SIGTERM; default: test_app's in-process server",
    "tests/jspec/tools/test_bench_serve.py::test_small_run_against_real_in_process_servers":
        "bench-serve end to end against real servers; default: its arithmetic and report tests",
    # --- log-probabilities ------------------------------------------------------------------------------------
    "tests/jspec/test_logprobs.py::test_speculative_logprobs_equal_plain_and_transformers[draft]":
        "the draft model's logprobs equal plain decoding's and transformers'; default: the [eagle3] tree's",
    "tests/jspec/test_logprobs.py::test_speculative_logprobs_equal_plain_and_transformers[ngram]":
        "n-gram's logprobs equal plain decoding's and transformers'; default: the [eagle3] tree's",
    "tests/jspec/test_logprobs.py::test_speculative_logprobs_equal_plain_and_transformers[ngram+eagle3]":
        "the hybrid's logprobs equal plain decoding's and transformers'; default: the [eagle3] tree's",
    "tests/jspec/test_logprobs.py::test_sampled_logprobs_are_the_raw_log_softmax":
        "sampled tokens' logprobs are the raw log-softmax; default: the greedy ones equal transformers' "
        "(test_plain_decoding_logprobs_equal_transformers, the [eagle3] speculative case)",
    "tests/jspec/test_logprobs.py::test_zero_top_logprobs_keep_the_chosen_tokens_only":
        "logprobs=0 returns the chosen tokens' only; default: logprobs=5 through the engine and the server",
    # --- paged tree attention (issue 31) -----------------------------------------------------------------------
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[interpret-case0-bf16]":
        "the paged tree-attention kernel (Triton form) on case 0 in bf16; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[interpret-case1-f32]":
        "the paged tree-attention kernel (Triton form) on case 1 in f32; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[interpret-case1-bf16]":
        "the paged tree-attention kernel (Triton form) on case 1 in bf16; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[interpret-case2-f32]":
        "the paged tree-attention kernel (Triton form) on case 2 in f32; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[interpret-case2-bf16]":
        "the paged tree-attention kernel (Triton form) on case 2 in bf16; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[tpu_interpret-case0-bf16]":
        "the paged tree-attention kernel (TPU form) on case 0 in bf16; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[tpu_interpret-case1-f32]":
        "the paged tree-attention kernel (TPU form) on case 1 in f32; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[tpu_interpret-case1-bf16]":
        "the paged tree-attention kernel (TPU form) on case 1 in bf16; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[tpu_interpret-case2-f32]":
        "the paged tree-attention kernel (TPU form) on case 2 in f32; default: case0 in f32",
    "tests/pallas_kernels/test_paged_tree_attention.py::test_kernel_equals_reference[tpu_interpret-case2-bf16]":
        "the paged tree-attention kernel (TPU form) on case 2 in bf16; default: case0 in f32",
    "tests/jspec/serve/test_paged.py::"
    "test_the_paged_tree_attention_kernel_keeps_every_row_equal_to_generate_alone":
        "the server's step programs through the paged kernel (interpreter) equal offline generate; default: the "
        "kernel against its reference (test_paged_tree_attention) and test_paged_rows_equal_generate_alone",
    "tests/jspec/test_forced_kernels.py":
        "the engine with every tree kernel forced to its TPU and its Triton form (interpreters) equals plain decoding "
        "on the bundled model, on one device and on dp 2 x tp 2; default: each kernel against its reference in both "
        "forms (tests/pallas_kernels) and test_sharded_kernels (the Triton forms per shard on 4 devices)",
    # --- quantization (issue 32) -----------------------------------------------------------------------------
    **{f"tests/jspec/test_quantized_engine.py::"
       f"test_greedy_speculation_equals_plain_decoding_of_the_same_quantized_target[{case}]":
       f"{case}: greedy speculation = plain decoding of the same quantized target; default: [eagle3-int8] (target "
       f"and head quantized) and the MTP int4 case (group-quantized target and modules)"
       for case in ("eagle3-fp8", "eagle3-int4", "draft-int8", "draft-fp8", "draft-int4", "ngram-int8", "ngram-fp8",
                    "ngram-int4")},
    "tests/jspec/test_quantized_engine.py::test_served_requests_equal_offline_generate_on_quantized_weights":
        "the slot engine (paged KV) on int4 weights with EAGLE-3 = offline generate; default: the quantized greedy "
        "cases (the same Dense in every program) and test_paged_rows_equal_generate_alone (the server's programs)",
    **{f"tests/models/test_quantized_checkpoints.py::{test}[{case}]": f"{why}; default: {kept}"
       for test, case, why, kept in [
        ("test_a_target_stored_quantized_loads_as_quantized_at_load", "int8",
         "int8 stored by jspec convert = quantized at load", "[int4] (qvalue widened on disk and narrowed back)"),
        ("test_a_target_stored_quantized_loads_as_quantized_at_load", "fp8",
         "fp8 stored by jspec convert = quantized at load", "[int4]"),
        ("test_a_quantized_checkpoint_converts_and_runs_as_its_dequantized_weights", "fp8-fp8",
         "compressed-tensors fp8 per channel = its dequantize-then-run reference", "[modelopt-fp8] (fp8 read)"),
        ("test_a_quantized_checkpoint_converts_and_runs_as_its_dequantized_weights", "int8-int8",
         "compressed-tensors int8 per channel = its dequantize-then-run reference", "[int4-int4] (same reader)")]},
    "tests/jspec/tools/test_bench.py::test_methods_side_by_side_on_quantized_weights":
        "jspec bench --quantization none,int8 runs every method on both weight formats, each lossless against its own "
        "plain decoding; default: the --quantization argument test and test_quantized_engine's default cases",
    "tests/jspec/test_quantized_engine.py::test_quantized_engine_holds_quantized_params":
        "the loaded engine's target and head kernels are int8 QArrays; default: [eagle3-int8] (the same engine, "
        "lossless) and test_which_kernels_are_quantized_and_how",
    "tests/jspec/test_spec_sampling.py::test_a_quantized_target_is_followed_exactly":
        "sampled speculation on int8 weights follows the quantized target's exact distribution (chi-square); default: "
        "the float chi-square tests (the same verify walk) and the quantized greedy cases",
    "tests/jspec/test_quantized_engine.py::test_mtp_greedy_equals_plain_decoding_of_the_same_quantized_target[int8]":
        "MTP on int8 weights = plain; default: [int4] (group-quantized modules)",
    "tests/jspec/test_quantized_engine.py::test_mtp_greedy_equals_plain_decoding_of_the_same_quantized_target[fp8]":
        "MTP on fp8 weights = plain; default: [int4] (group-quantized modules)",
    "tests/jspec/test_quantized_engine.py::test_a_mesh_equals_one_device_and_splits_the_quantized_bytes":
        "int8 on tp 2 and dp 2 x tp 2 = one device, each device holding its share of the quantized bytes; default: "
        "test_sharded_params (the placement rules) and tests/models/test_quantization (the QArray leaves)",
    # --- structured outputs -----------------------------------------------------------------------------------
    "tests/jspec/structured_outputs/test_structured_generation.py::"
    "test_twenty_json_schemas_validate_and_speculation_equals_plain":
        "20 JSON schemas: every output validates, eagle3 / draft / n-gram / hybrid equal plain decoding under the "
        "grammar; default: test_speculative_equals_plain_under_json_regex_choice_and_grammar (eagle3's tree under "
        "a schema, a regex, a choice and a Lark grammar at once)",
    "tests/jspec/structured_outputs/test_structured_generation.py::test_sampled_outputs_match_their_constraints":
        "sampled outputs under grammars still match them; default: the greedy mixed case and test_tree_masks",
    "tests/jspec/serve/test_app.py::test_structured_outputs_through_the_client_equal_offline":
        "response_format / structured_outputs through the official client equal offline generate, mixed with an "
        "unconstrained request, chunked prefill under a grammar; default: the offline mixed case, "
        "test_tree_masks and test_protocol (request parsing)",
    "tests/jspec/serve/test_memory_maps.py::test_a_server_past_the_limit_is_refused_before_compiling_the_rest":
        "a server whose programs would pass vm.max_map_count is refused after one compile; default: "
        "test_room_for_counts_this_process_against_the_limit",
    # --- logits processors ------------------------------------------------------------------------------------
    "tests/jspec/test_logits_processors.py::test_plain_decoding_equals_transformers_processors[bias-min-tokens]":
        "logit_bias and min_tokens equal transformers' SequenceBias and MinNewTokensLength; default: the "
        "[repetition-banned] case, and test_app's served penalties with min_tokens equal offline",
    "tests/jspec/test_logits_processors.py::test_speculative_equals_plain_with_the_same_processors[draft]":
        "the draft model under penalties equals plain decoding; default: the [eagle3] tree's (the same verify path)",
    "tests/jspec/test_logits_processors.py::test_speculative_equals_plain_with_the_same_processors[ngram]":
        "n-gram under penalties equals plain decoding; default: the [eagle3] tree's (the same verify path)",
    "tests/jspec/test_logits_processors.py::test_speculative_equals_plain_with_the_same_processors[ngram+eagle3]":
        "the hybrid under penalties equals plain decoding; default: the [eagle3] tree's (the same verify path)",
    "tests/jspec/test_spec_sampling.py::test_first_three_tokens_follow_the_penalized_target":
        "sampling under penalties follows the processed target (chi-square); default: "
        "test_logits_processors (greedy per-node processing equals plain decoding and transformers)",
    # --- speculative output equals plain decoding ----------------------------------------------------------------
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[random-chain]":
        "EAGLE-3 chain greedy = plain (random head); default: test_tree_selection's bundled chains, test_hybrid",
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[distilled-static]":
        "EAGLE-3 static tree greedy = plain (a distilled head: real acceptance); default: "
        "test_stops_at_eos_inside_an_accepted_run, and the bundled head's real acceptance in test_tree_selection "
        "and test_hybrid",
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[distilled-dynamic]":
        "EAGLE-3 dynamic tree greedy = plain (a distilled head); default: test_stops_at_eos_inside_an_accepted_run"
        "[dynamic], test_tree_selection",
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[distilled-chain]":
        "EAGLE-3 chain greedy = plain (distilled head); default: test_tree_selection (chains of the bundled head)",
    "tests/jspec/test_spec_engine.py::test_from_pretrained_with_a_converted_head":
        "a converted HF head through from_pretrained = plain; default: test_eagle3_layouts (every layout converts "
        "to the same head) and test_train_drafter's exported head driving the engine",
    "tests/jspec/test_spec_engine.py::test_stream_concatenates_to_generate[chain]":
        "stream = generate for a chain; default: [dynamic]",
    "tests/jspec/test_spec_engine.py::test_stops_at_eos_inside_an_accepted_run[static]":
        "EAGLE-3 stops at EOS inside an accepted run of a static tree; default: [chain], [dynamic]",
    "tests/jspec/test_dflash.py::test_sampled_tokens_follow_the_exact_target_distribution":
        "DFlash chains and dynamic trees and DSpark under its confidence cut, sampled at T=1, follow the target's "
        "exact distribution (chi-square); default: test_spec_sampling (the same verify walk over deterministic "
        "drafts) and test_draft_model's shortened chain (rows drafting part of the chain)",
    "tests/jspec/train/test_pard.py::test_pard_trains_converts_and_drives_the_engine_losslessly":
        "PARD training -> AMD's layout -> convert -> the engine, greedy = plain; default: "
        "test_every_copy_position_equals_the_inference_forward (the packed copies are PARD's inference) and "
        "test_train_drafter's DFlash round trip (train, export, convert, drive the engine)",
    "tests/jspec/test_pard.py::test_sampled_tokens_follow_the_exact_target_distribution":
        "a PARD chain sampled at T=1 follows the target's exact distribution (chi-square); default: "
        "test_spec_sampling (the same verify walk over deterministic drafts)",
    "tests/jspec/test_draft_model.py::test_greedy_output_equals_plain_decoding[static]":
        "draft-model static tree greedy = plain; default: test_pard's [chain] and test_dflash's [static] (the "
        "verify and commit of a static tree)",
    "tests/jspec/test_draft_model.py::test_exact_copy_of_the_target_accepts_every_draft[static]":
        "a copy of the target accepts every draft of a static tree; default: [chain]",
    "tests/jspec/test_draft_model.py::test_from_pretrained_with_a_draft_model_or_ngram":
        "from_pretrained with a converted draft model = plain; default: the bundled draft in test_tree_selection",
    "tests/jspec/test_mtp.py::test_greedy_output_equals_plain_decoding_dynamic_tree[vanilla-deepseek]":
        "MTP vanilla dynamic tree greedy = plain; default: [mtp_eagle-mimo]",
    "tests/jspec/test_mtp.py::test_acceptance_equals_the_host_replay[mtp_eagle-deepseek-scales1]":
        "MTP acceptance equals a host replay (DeepSeek layout); default: test_mtp's greedy = plain",
    "tests/jspec/test_mtp.py::test_acceptance_equals_the_host_replay[vanilla-mimo-scales2]":
        "MTP vanilla acceptance equals a host replay; default: test_mtp's greedy = plain",
    "tests/jspec/test_mtp.py::test_from_pretrained_with_the_targets_own_modules":
        "from_pretrained with the target's MTP modules = plain; default: test_mtp_checkpoint's converted modules",
    "tests/jspec/test_mtp.py::test_vanilla_prefill_and_commit_state_equals_the_recomputation":
        "MTP vanilla's cached state equals a recomputation; default: greedy = plain [mtp_eagle-mimo]",
    ("tests/models/test_mtp_checkpoint.py::"
     "test_from_pretrained_with_the_converted_modules_is_lossless[mimo-qwen2-mtp-3]"):
        "converted MiMo modules drive the engine losslessly; default: [deepseek-llama-mtp_vanilla-2]",
    "tests/jspec/test_tree_selection.py::test_top1_chain_greedy_equals_plain_on_the_bundled_model[draft]":
        "top1_chain selection with the bundled draft model = plain; default: [eagle3]",
    "tests/jspec/test_ngram.py::test_greedy_output_equals_plain_decoding[branches]":
        "n-gram branching tree greedy = plain; default: test_random_target_greedy_is_lossless (branches)",
    "tests/jspec/test_draft_model.py::test_greedy_output_equals_plain_decoding[dynamic]":
        "draft-model dynamic tree greedy = plain; default: test_pard's [chain], test_spec_engine's EOS test "
        "[dynamic]",
    "tests/jspec/test_hybrid.py::test_greedy_output_equals_plain_decoding":
        "ngram+eagle3 with a random head greedy = plain; default: test_bundled_ngram_eagle3_equals_plain_decoding",
    "tests/jspec/test_hybrid.py::test_the_servers_short_chain_composes_with_the_shorter_model_chain":
        "the server's short chain cut on the hybrid (below and above its head's chain) keeps greedy output; default: "
        "test_app's test_every_step_program_in_turn_keeps_greedy_output (the cut on prompt lookup's chain), "
        "test_greedy_output_equals_plain_decoding_with_a_shorter_model_chain (the hybrid's own cut)",
    "tests/jspec/test_hybrid.py::test_greedy_output_equals_plain_decoding_with_a_shorter_model_chain":
        "ngram+eagle3 with the head's chain shorter than lookup's greedy = plain; default: the bundled chain of "
        "11 (test_bundled_ngram_eagle3_equals_plain_decoding), whose head drafts 7",
    "tests/jspec/test_ngram.py::test_greedy_output_equals_plain_decoding[dynamic]":
        "n-gram dynamic tree greedy = plain; default: test_random_target_greedy_is_lossless, the EOS test (chain)",
    "tests/jspec/test_user_drafters.py::test_cli_generate_with_an_entry_point_drafter":
        "jspec generate runs a drafter registered by entry point; default: the registry and Python-usage tests",
    "tests/jspec/serve/test_slots.py::test_every_request_equals_generate_alone_greedy[plain]":
        "the slot engine without a drafter equals generate alone; default: [eagle3-dynamic], test_app's served "
        "request (the CPU default drafter)",
    "tests/jspec/serve/test_slots.py::test_every_request_equals_generate_alone_greedy[ngram]":
        "the slot engine with n-gram drafting equals generate alone; default: [eagle3-dynamic], test_app",
    "tests/jspec/serve/test_slots.py::test_every_request_equals_generate_alone_greedy[dflash]":
        "the server's DFlash rows each equal offline generate; default: test_paged's cached-prefix test [dflash] "
        "(its paged state), test_dflash (offline = plain)",
    "tests/jspec/serve/test_slots.py::test_every_request_equals_generate_alone_greedy[draft-model]":
        "the slot engine with a draft model equals generate alone; default: [eagle3-dynamic], test_app",
    "tests/jspec/serve/test_paged.py::test_paged_rows_equal_generate_alone":
        "rows in scattered pages equal generate alone, stepped by the paged functions without the scheduler (no "
        "drafter, EAGLE-3 trees, n-gram lookup's token buffer, a draft model's whole KV cache); default: "
        "test_slots' test_every_request_equals_generate_alone_greedy[eagle3-dynamic] (the scheduler over the same "
        "paged step, a drafter cache paged), test_paged_scheduler, test_app (the n-gram server)",
    "tests/jspec/serve/test_paged_scheduler.py::test_a_pool_too_small_preempts_and_every_request_equals_generate_alone[eagle3-dynamic]":
        "preemption by recompute with a drafter cache paged; default: [plain], test_slots' [eagle3-dynamic] rows",
    "tests/jspec/serve/test_paged_scheduler.py::test_a_shared_prefix_is_computed_once_and_outputs_are_unchanged[ngram]":
        "the scheduler's prefix hits with n-gram lookup; default: test_app's shared-prefix test (the CPU default "
        "drafter, n-gram, over HTTP), test_paged's cached-prefix test, test_block_manager",
    "tests/jspec/serve/test_slots.py::test_switching_between_step_programs_and_buckets_keeps_greedy_output":
        "adaptive switching between step programs and length buckets keeps greedy output; default: "
        "test_app's test_every_step_program_in_turn_keeps_greedy_output (the default server's three step "
        "programs in turn), test_adapt's unit tests",
    "tests/jspec/serve/test_slots.py::test_the_short_chain_program_keeps_greedy_output[ngram]":
        "the short chain program with n-gram lookup keeps greedy output, the pool never copied; default: test_app's "
        "test_every_step_program_in_turn_keeps_greedy_output (the same programs on the default server over HTTP, "
        "the same pool check)",
    "tests/jspec/serve/test_slots.py::test_the_short_chain_program_keeps_greedy_output[draft-model]":
        "the short chain program with a draft model (a paged drafter cache, drafts drawn from the drafter's "
        "distribution) keeps greedy output; default: test_app's test_every_step_program_in_turn_keeps_greedy_output "
        "(n-gram lookup, the CPU default drafter), test_draft_model's "
        "cut-chain distribution test (the draft model's commit of a cut chain)",
    "tests/jspec/serve/test_slots.py::test_nothing_compiles_after_warm_up":
        "every occupancy and length bucket of an adaptive slot engine compiles nothing; default: test_app's "
        "test_the_scheduler_compiles_nothing_while_serving",
    "tests/jspec/serve/test_paged_scheduler.py::test_a_shared_prefix_is_computed_once_and_outputs_are_unchanged[plain]":
        "prefix caching without a drafter; default: test_app's shared-prefix test, test_paged's cached-prefix test",
    "tests/jspec/serve/test_paged_scheduler.py::test_a_shared_prefix_is_computed_once_and_outputs_are_unchanged[eagle3-dynamic]":
        "the scheduler's prefix hits for EAGLE-3 (last page recomputed); default: test_paged's "
        "test_a_cached_prefix_continues_as_a_whole_prefill[eagle3-dynamic], test_block_manager's drop_last_hit test",
    "tests/jspec/serve/test_paged.py::test_a_cached_prefix_continues_as_a_whole_prefill[hybrid]":
        "the hybrid's head and lookup continue from a cached prefix; default: [eagle3-dynamic]",
    "tests/jspec/serve/test_paged.py::test_a_cached_prefix_continues_as_a_whole_prefill[plain]":
        "the target alone from a cached prefix; default: [eagle3-dynamic] (the target's K/V checked there too)",
    "tests/jspec/serve/test_paged_scheduler.py::test_a_long_prompt_is_prefilled_in_pieces_between_chunks_of_the_running_rows[eagle3-dynamic]":
        "chunked prefill with EAGLE-3, each piece's last page recomputed; default: [plain] (prefill in pieces "
        "between chunks), test_paged's test_a_cached_prefix_continues_as_a_whole_prefill[eagle3-dynamic] (the head "
        "continuing from pages already written)",
    "tests/jspec/serve/test_paged_scheduler.py::test_pages_hold_more_requests_than_static_slots_would":
        "admission by pages lets more requests run than static slots would; default: "
        "test_a_pool_too_small_preempts_and_every_request_equals_generate_alone[plain] (admission and "
        "preemption by pages)",
    "tests/jspec/serve/test_app.py::test_shutting_down_answers_503":
        "a draining server answers 503; default: test_before_warm_up_health_and_requests_answer_503",
    "tests/jspec/serve/test_sharded_serve.py":
        "the slot engine on a tp 4 mesh equals one device offline; default: test_multihost's tp 4 engine, "
        "test_app's served request",
    "tests/jspec/test_per_request_seeds.py::test_a_prompt_draws_the_same_tokens_alone_or_in_a_crowd[draft-model]":
        "per-prompt seeds with a draft model: alone = in a crowd; default: the other drafters' cases",
    "tests/jspec/test_capture_hidden_states.py::test_captured_states_match_transformers[self_draft_dynamic]":
        "hidden states captured during a dynamic-tree speculation = transformers; default: [plain]",
    "tests/jspec/test_auto.py::test_real_step_cost_measurement_runs_in_the_loop_and_streamed":
        "auto's real step timing in the loop and streamed; default: test_tune_cmd (real streamed timing), the "
        "fake-clock arithmetic tests",
    "tests/jspec/train/test_eagle3_data_parallel.py":
        "EAGLE-3 training data parallel over 2 devices = one device's loss; default: the one-device training tests",
    "tests/jspec/tools/test_eval_acceptance.py::test_a_slice_of_prompts_with_top1_chain_trees_equals_plain":
        "scripts/eval_acceptance.py on a slice of HumanEval = plain; default: test_tree_selection",
    "tests/models/test_eagle3_layouts.py::test_layer_ids_are_honoured":
        "a SpecForge head's layer ids move the taps (lossless, drafts differ); default: "
        "test_every_layout_converts_to_the_same_head (each layout's ids read into the same taps)",
    "tests/jspec/test_chat.py::test_engine_chat_is_generate_on_the_rendered_ids_and_stops_at_end_of_turn":
        "engine.chat = generate on the rendered ids, stopping at the end of turn; default: "
        "test_cli_chat_prints_what_engine_chat_generates (engine.chat through the CLI) and the rendering tests "
        "against transformers' apply_chat_template",
    "tests/jspec/tools/test_roofline.py::test_synthetic_through_a_one_device_mesh":
        "the roofline rows through the mesh code path on a 1x1 mesh; default: the roofline plan, floor and report "
        "tests, and test_sharded_params (the mesh placement it uses)",
    "tests/jspec/test_generate_program.py::test_mtp_generate_is_one_loop_holding_target_and_modules[vanilla-5]":
        "vanilla MTP's generate is one loop holding target and modules; default: [mtp_eagle-3] (the same program "
        "shape with the other module chaining)",
    "tests/jspec/tools/test_roofline.py::test_json_is_the_report_and_complete":
        "jspec bench --roofline's JSON report; default: the roofline plan, floor and report tests",
    "tests/jspec/serve/test_slots.py::test_a_sampled_request_draws_the_same_tokens_alone_or_in_a_crowd[draft-model]":
        "a seeded request on the slot engine with a draft model: alone = in a crowd; default: the other drafters'",
    "tests/jspec/test_ngram.py::test_repeated_prompt_is_drafted_from":
        "lookup drafts from a repeated prompt and accepts them; default: test_hybrid's bundled test (lookup "
        "drafts accepted on real text), test_no_match_skips_the_verify_pass",
    ("tests/models/test_mtp_checkpoint.py::"
     "test_from_pretrained_with_the_converted_modules_is_lossless[deepseek-llama-mtp_vanilla-2]"):
        "converted DeepSeek MTP modules drive the engine losslessly; default: test_mtp's greedy = plain, the "
        "converters' round trips",
    "tests/jspec/test_generate_program.py::test_speculative_generate_is_one_loop_holding_both_models[chain]":
        "a chain's generate is one while loop holding both models; default: [dynamic]",
    "tests/jspec/test_generate_program.py::test_speculative_generate_is_one_loop_holding_both_models[static]":
        "a static tree's generate is one while loop holding both models; default: [dynamic]",
    "tests/jspec/test_draft_model.py::test_exact_copy_of_the_target_accepts_every_draft[chain]":
        "a copy of the target as draft model accepts every draft; default: test_spec_engine's forced-acceptance "
        "statistics",
    "tests/jspec/test_user_drafters.py::test_greedy_output_is_the_targets_and_drafts_are_accepted[branches]":
        "a user drafter's branching tree greedy = plain; default: test_docs_python_usage_runs (its chain)",
    "tests/jspec/test_hybrid.py::test_stops_at_eos_inside_an_accepted_run":
        "ngram+eagle3 stops at EOS inside an accepted run; default: test_spec_engine's and test_ngram's EOS tests",
    "tests/jspec/train/test_train_drafter.py::test_draft_model_trains_and_converts":
        "a draft model trains and converts; default: test_eagle3_head_trains_and_converts",
    "tests/jspec/test_compile_options.py::test_greedy_output_is_the_same_under_either_options":
        "greedy output is the same under either XLA option set; default: every greedy = plain test (the default "
        "options), test_speculative_steps_compile_without_ynn_fusions_and_plain_steps_with_defaults",
    "tests/jspec/test_engine_vs_hf.py::test_greedy_matches_transformers[mistral]":
        "Mistral greedy generation = transformers'; default: [llama]",
    "tests/jspec/test_engine_vs_hf.py::test_greedy_matches_transformers[qwen2]":
        "Qwen2 greedy generation = transformers'; default: [llama]",
    "tests/jspec/test_mtp.py::test_acceptance_equals_the_host_replay[mtp_eagle-mimo-scales0]":
        "MTP acceptance equals a host replay; default: greedy = plain [mtp_eagle-mimo]",
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[random-static]":
        "EAGLE-3 static tree greedy = plain; default: test_stops_at_eos_inside_an_accepted_run[dynamic] (the same "
        "verify and commit), the static tree arrays in test_trees and tree_build's kernel tests",
    "tests/jspec/test_spec_engine.py::test_greedy_output_equals_plain_decoding[random-dynamic]":
        "EAGLE-3 dynamic tree greedy = plain (random head: drafts mostly rejected); default: "
        "test_stops_at_eos_inside_an_accepted_run[chain] and [dynamic] (greedy = plain, distilled head), "
        "test_tree_selection's bundled dynamic tree",
    "tests/jspec/test_ngram.py::test_no_match_skips_the_verify_pass[False]":
        "no lookup match: the step runs the target on the root alone; default: [True] (the same step with a "
        "match), test_random_target_greedy_is_lossless (steps with and without matches = plain)",
    "tests/jspec/test_draft_model.py::test_greedy_output_equals_plain_decoding[chain]":
        "draft-model chain greedy = plain; default: test_pard's greedy [chain] (the draft model's prefill and "
        "commit), test_a_shortened_chain_follows_the_exact_target_distribution (its drafting, sampled)",
    "tests/jspec/serve/test_slots.py::test_a_cancelled_request_frees_its_slot_and_the_queue_is_bounded":
        "a cancelled request frees its slot within one chunk; the queue is bounded; default: test_app's "
        "test_a_closed_stream_frees_its_slot and test_a_dropped_connection_frees_its_slot, its 503 tests",
    "tests/jspec/test_dflash.py::test_dspark_dynamic_tree_greedy_equals_plain_decoding":
        "DSpark's best-first tree with Markov-biased children greedy = plain; default: test_dflash's [dynamic] (the "
        "same search), the DSpark chain test (the same bias)",
    "tests/jspec/test_user_drafters.py::test_greedy_output_is_the_targets_and_drafts_are_accepted[chain]":
        "a user-registered chain drafter's greedy output = plain with drafts accepted; default: "
        "test_docs_python_usage_runs (the docs' usage of the same drafter asserts both)",
    "tests/jspec/test_user_drafters.py::test_sampled_output_is_reproducible_per_prompt":
        "a user drafter's sampled tokens repeat per prompt seed, greedy and sampled share a program; default: "
        "test_per_request_seeds (the same property for the built-in drafters)",
    "tests/jspec/test_pard.py::test_greedy_output_equals_plain_decoding[static]":
        "PARD's per-position top-k static tree greedy = plain; default: [chain], test_dflash's [static] (the same "
        "per-position tree from one forward)",
    "tests/jspec/train/test_train_drafter.py::test_dspark_trains_in_deepspecs_layout_and_drives_the_engine_losslessly":
        "DSpark trained with DeepSpec's loss, exported in its layout, converted, lossless in the engine; default: "
        "test_dflash_trains_converts_and_drives_the_engine_losslessly (the same loop and round trip), "
        "test_dflash's DSpark reference and engine tests",
    "tests/jspec/test_ngram.py::test_greedy_output_equals_plain_decoding[chain]":
        "n-gram chain greedy = plain on the near-bigram target; default: test_random_target_greedy_is_lossless, "
        "test_no_match_skips_the_verify_pass[True], test_hybrid's bundled lookup",
    "tests/jspec/train/test_train_drafter.py::test_exported_head_drives_the_engine_losslessly":
        "a trained, exported, converted EAGLE-3 head drives the engine = plain; default: "
        "test_dflash_trains_converts_and_drives_the_engine_losslessly (the same round trip for DFlash), "
        "test_eagle3_head_trains_and_converts",
    "tests/jspec/test_ngram.py::test_root_only_step_samples_the_target_distribution":
        "a step with no draft samples the target's distribution (chi-square); default: test_sampling's "
        "chi-square of the sampler every step uses",
    "tests/jspec/test_bf16_numerics.py::test_bf16_divergences_are_near_ties":
        "bf16 speculative output leaves plain decoding only at near-ties (docs/numerics.md's bound); default: "
        "test_verify_pass_logits_within_bound",
    "tests/jspec/test_bf16_numerics.py::test_float32_speculative_equals_plain":
        "float32 speculative = plain for each drafter on the bundled model; default: every drafter's own greedy "
        "test",
    "tests/jspec/test_bf16_numerics.py::test_recomputed_logits_are_plain_decodings":
        "bf16 recomputed logits are plain decoding's; default: test_verify_pass_logits_within_bound",
    "tests/jspec/test_attention.py::test_model_hands_the_offset_to_attention":
        "the model hands the cache offset to attention; default: the attention tests against jax's, every "
        "cached decode = transformers test",
    "tests/jspec/test_draft_model.py::test_stops_at_eos_inside_an_accepted_run":
        "a draft model stops at EOS inside an accepted run; default: test_spec_engine's and test_ngram's",
    "tests/jspec/tools/test_cli_process.py::test_a_second_identical_call_compiles_nothing":
        "a second identical `jspec generate` process loads every program from $JSPEC_HOME's cache; default: "
        "test_cli's compiled programs kept under $JSPEC_HOME",
    "tests/jspec/tools/test_roofline.py::test_header_bytes_by_hand":
        "the roofline's safetensors header bytes by hand; default: the roofline's command line and floor tests",
    "tests/jspec/tools/test_roofline.py::test_bandwidth_is_read_plus_write_over_the_median_pass":
        "the roofline's bandwidth arithmetic on a tiny run; default: test_roofline_floor",
    "tests/jspec/tools/test_roofline.py::test_row_is_timed_with_the_forced_acceptance":
        "the roofline row is timed at the forced acceptance; default: test_roofline_plan",
    "tests/jspec/tools/test_roofline.py::test_step_time_is_the_median_difference_per_verify_step":
        "the roofline's step time arithmetic; default: test_roofline_floor",
    "tests/jspec/tools/test_roofline.py::test_floor_of_the_row_by_hand":
        "the roofline row's floor by hand; default: test_roofline_floor",
    "tests/jspec/tools/test_roofline.py::test_dflash_row_commits_its_whole_block_in_as_many_steps_as_the_bucket_holds":
        "the roofline times a DFlash chain at its whole block; default: test_roofline_floor's DFlash bytes, "
        "test_roofline_plan's bucket arithmetic",
    "tests/jspec/tools/test_roofline.py::test_table_shows_the_row":
        "the roofline table; default: test_roofline_report",
    "tests/models/test_llama_vs_hf.py::test_config_matches_family[mistral]":
        "Mistral's config read as transformers reads it; default: [llama], [qwen3], test_shipped_targets",
    "tests/models/test_llama_vs_hf.py::test_config_matches_family[qwen2]":
        "Qwen2's config read as transformers reads it; default: [llama], [qwen3], test_shipped_targets' qwen2.5",
    "tests/models/test_llama_vs_hf.py::test_hidden_state_taps_match_transformers[mistral]":
        "Mistral hidden-state taps = transformers; default: [llama], [qwen3]",
    "tests/models/test_llama_vs_hf.py::test_hidden_state_taps_match_transformers[qwen2]":
        "Qwen2 hidden-state taps = transformers; default: [llama], [qwen3]",
    "tests/models/test_llama_vs_hf.py::test_tree_mask_equals_separate_causal_branches[qwen2]":
        "a tree mask = separate causal branches (Qwen2); default: [llama]",
    "tests/models/test_shipped_targets.py::test_engine_from_converted_dir[qwen2.5-instruct]":
        "the engine on a converted Qwen2.5 as shipped; default: [qwen3]",
    "tests/jspec/test_per_request_seeds.py::test_a_prompt_draws_the_same_tokens_alone_or_in_a_crowd[plain]":
        "per-prompt seeds with plain decoding: alone = in a crowd; default: [ngram]",
    "tests/jspec/test_generate_program.py::test_speculative_same_bucket_compiles_nothing_new":
        "a second speculative call in the same bucket compiles nothing; default: test_same_bucket_compiles_nothing_new "
        "(plain decoding, the same bucketing)",
    "tests/jspec/test_per_request_seeds.py::test_a_prompt_draws_the_same_tokens_alone_or_in_a_crowd[eagle3-dynamic]":
        "per-prompt seeds with an EAGLE-3 dynamic tree: alone = in a crowd; default: [ngram]",
    "tests/jspec/test_auto.py::test_auto_engine_on_the_bundled_model_equals_plain_decoding":
        "the engine auto returns on the bundled model = plain; default: test_cli_default_runs_auto_and_says_why "
        "(auto's engine end to end) and each drafter's greedy = plain",
    "tests/models/test_mtp_checkpoint.py::test_the_stored_tree_is_the_module_s[mimo-qwen2]":
        "MiMo's MTP modules stored as the module's tree; default: [deepseek-llama]",
    "tests/models/test_mtp_checkpoint.py::test_convert_then_load_gives_the_modules_back[deepseek-qwen3-tied]":
        "DeepSeek MTP modules on a tied Qwen3 convert and load back; default: [deepseek-llama], [mimo-qwen2]",
    "tests/models/test_mtp_checkpoint.py::test_the_target_converts_as_without_modules[deepseek-qwen3-tied]":
        "a tied Qwen3 target with MTP modules converts as without them; default: [deepseek-llama]",
    "tests/models/test_eagle3.py::test_write_hf_eagle3_round_trip[bfloat16]":
        "a head written in bf16 in HF layout reads back; default: [float32]",
    "tests/models/test_shipped_targets.py::test_logits_match_transformers[qwen3-9000]":
        "Qwen3 logits at 9000 positions = transformers; default: [qwen3-None], the Llama-3.1 rope-scaling case",
    "tests/models/test_shipped_targets.py::test_logits_match_transformers[qwen2.5-instruct-9000]":
        "Qwen2.5 logits at 9000 positions = transformers; default: [qwen2.5-instruct-None]",
    # --- sampling is the target's distribution ---------------------------------------------------------------------
    "tests/jspec/test_draft_model.py::test_sampled_drafts_follow_the_exact_target_distribution[chain]":
        "draft-model chain of 2 sampled drafts chi-square in the engine; default: "
        "test_a_shortened_chain_follows_the_exact_target_distribution (the draft model's sampled chain through the "
        "same engine path, verified after one draft), test_tree_verify's test_sampling_is_lossless[3-2-True] "
        "(deeper sampled drafts, the same verifier)",
    "tests/jspec/test_draft_model.py::test_sampled_drafts_follow_the_exact_target_distribution[tree]":
        "draft-model tree (recursive rejection) chi-square in the engine; default: test_tree_verify's "
        "test_sampling_is_lossless[3-2-True] (sampled drafts over a tree of siblings, the same verifier)",
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_is_lossless[4-3-True]":
        "recursive rejection over 4 x 3 sampled siblings; default: [3-2-True], [1-1-True], [3-2-False]",
    "tests/jspec/test_spec_sampling.py::test_first_three_tokens_follow_the_target[dynamic-top-p]":
        "EAGLE-3 dynamic tree sampling with top-p chi-square; default: [dynamic] (top-k)",
    "tests/jspec/test_spec_sampling.py::test_first_three_tokens_follow_the_target[static]":
        "EAGLE-3 static tree sampling chi-square (deterministic drafts); default: [dynamic], the same path",
    "tests/jspec/test_spec_sampling.py::test_first_three_tokens_follow_the_target[chain]":
        "EAGLE-3 chain sampling chi-square (deterministic drafts); default: [dynamic], the same verify path "
        "(Gumbel-max walk)",
    "tests/jspec/test_mtp.py::test_sampled_tokens_follow_the_exact_target_distribution":
        "MTP drafting sampling chi-square (deterministic drafts); default: test_spec_sampling [dynamic], the same "
        "verify path",
    "tests/jspec/test_hybrid.py::test_sampling_follows_the_exact_target_distribution":
        "ngram+eagle3 sampling chi-square (deterministic drafts); default: test_spec_sampling, the same path",
    "tests/jspec/test_ngram.py::test_random_target_sampling_follows_the_exact_distribution":
        "n-gram chain and branching-tree sampling chi-square (deterministic drafts); default: test_spec_sampling, "
        "test_root_only_step_samples_the_target_distribution",
    # --- kernels against references ---------------------------------------------------------------------------------
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference[5-3-33-6-interpret]":
        "sampling kernel = reference (5 rows, 33 nodes, depth 6); default: [5-1-1-1], [5-3-8-3]",
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference[33-3-8-3-interpret]":
        "sampling kernel = reference (33 rows); default: the 5-row cases",
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference[33-3-33-6-interpret]":
        "sampling kernel = reference (33 rows, depth 6); default: the 5-row cases",
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference[33-1-1-1-interpret]":
        "sampling kernel = reference (33 rows, one node); default: [5-1-1-1-interpret]",
    "tests/pallas_kernels/test_tree_verify.py::test_per_row_keys_make_each_row_independent_of_the_others[reference]":
        "per-row keys make rows independent (reference); default: [interpret]",
    "tests/jspec/test_sampling.py::test_generated_pairs_follow_the_exact_target_distribution[sampling_row0]":
        "two sampled tokens at temperature 1 follow the target's joint distribution (chi-square); default: "
        "[sampling_row1] (temperature, top-k and top-p)",
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference[33-1-33-32-interpret]":
        "sampling kernel = reference (33 rows, a 33-node chain); default: [5-1-1-1], [5-3-8-3]",
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference[5-1-33-32-interpret]":
        "sampling kernel = reference (a 33-node chain); default: [5-1-1-1], [5-3-8-3]",
    # --- models against transformers ---------------------------------------------------------------------------------
    "tests/models/test_llama_vs_hf.py::test_prefill_and_cached_decode_match_transformers[mistral]":
        "Mistral logits = transformers (sliding window off); default: [llama], [qwen3], test_shipped_targets",
    "tests/models/test_llama_vs_hf.py::test_prefill_and_cached_decode_match_transformers[qwen2]":
        "Qwen2 logits = transformers; default: [llama], [qwen3], test_shipped_targets' qwen2.5",
    "tests/models/test_llama_vs_hf.py::test_tree_mask_equals_separate_causal_branches[mistral]":
        "a tree mask = separate causal branches (Mistral); default: [llama], [qwen2]",
    "tests/models/test_llama_vs_hf.py::test_tree_mask_equals_separate_causal_branches[qwen3]":
        "a tree mask = separate causal branches (Qwen3); default: [llama], [qwen2]",
    "tests/models/test_shipped_targets.py::test_engine_from_converted_dir[llama3.1-instruct]":
        "the engine on a converted Llama-3.1 as shipped; default: [qwen3], [qwen2.5-instruct]",
    "tests/models/test_shipped_targets.py::test_logits_match_transformers[llama3.1-instruct-9000]":
        "Llama-3.1 rope scaling at 9000 positions = transformers; default: [llama3.1-instruct-120000]",
    "tests/jspec/test_capture_hidden_states.py::test_captured_states_match_transformers[ngram]":
        "hidden states captured during n-gram speculation = transformers; default: [plain], "
        "[self_draft_dynamic]",
    "tests/jspec/test_capture_hidden_states.py::test_eagle3_head_keeps_its_taps_while_capturing":
        "an EAGLE-3 head keeps its own taps while the caller captures others; default: capture [plain], "
        "[self_draft_dynamic]",
    # --- checkpoints and tools ---------------------------------------------------------------------------------------
    "tests/models/test_streaming_convert.py::test_sharded_conversion_peak_memory_is_about_the_largest_array":
        "conversion streams: peak memory about the largest array; default: the converters' equality tests",
    "tests/models/test_mtp_checkpoint.py::test_the_target_converts_as_without_modules[mimo-qwen2]":
        "a MiMo target with MTP modules converts as without them; default: [deepseek-llama]",
    "tests/jspec/tools/test_draft_vocab_table.py":
        "scripts/draft_vocab_table.py's rows on the bundled head; default: test_draft_vocab (shrink_draft_vocab)",
    "tests/jspec/tools/test_bench.py::test_small_run_matches_transformers":
        "jspec bench's table against transformers' generation; default: the bench argument and report tests",
    "tests/jspec/tools/test_cli.py::test_bundled_eagle3_generates_plain_decodings_tokens_with_fewer_target_steps":
        "the CLI with the bundled head = plain with fewer steps; default: "
        "test_speculative_stream_equals_plain_decoding_and_counts_steps_as_generate, test_auto's bundled engine",
    "tests/jspec/tools/test_cli.py::test_train_drafter_runs_end_to_end":
        "jspec train-drafter through the CLI; default: tests/jspec/train/test_train_drafter.py",
    "tests/jspec/train/test_train_drafter.py::test_a_second_stage_starts_from_the_first_stages_head":
        "--init-head starts a stage from an earlier head; default: test_eagle3_head_trains_and_converts",
    "tests/jspec/test_chat.py::test_cli_chat_streams_the_rendered_prompt_and_engine_chats_reply":
        "jspec generate --chat streamed = engine.chat; default: test_cli_chat_prints_what_engine_chat_generates",
}


# The TPU (Mosaic) forms in Pallas's TPU interpreter (issue 31): every case but a few representatives runs in the slow
# tier; the default tier keeps, per kernel, the published SGLang vectors and one or two random cases (below).
TPU_FORM_DEFAULT = {
    "tests/pallas_kernels/test_tree_attention.py::test_kernel_matches_reference": ("L600-gqa1-D40-chain-bf16",),
    "tests/pallas_kernels/test_tree_build.py::test_sglang_build_tree_kernel_efficient_vector": ("",),
    "tests/pallas_kernels/test_tree_build.py::test_dynamic_kernel_matches_reference_on_garbage": ("True",),
    "tests/pallas_kernels/test_tree_verify.py::test_sglang_verify_tree_greedy_vector": ("",),
    "tests/pallas_kernels/test_tree_verify.py::test_sampling_kernel_matches_reference": ("33-3-33-6",),
}
TPU_FORM_MODULES = ("tests/pallas_kernels/test_tree_attention.py", "tests/pallas_kernels/test_tree_build.py",
                    "tests/pallas_kernels/test_tree_verify.py")


def _is_slow_tpu_form(nodeid: str) -> bool:
    """A TPU-interpreter case of the tree kernels that is not one of TPU_FORM_DEFAULT's representatives."""
    module, _, rest = nodeid.partition("::")
    if module not in TPU_FORM_MODULES or "tpu_interpret" not in rest:
        return False
    function, _, params = rest.partition("[")
    params = params.rstrip("]").replace("tpu_interpret", "").strip("-")
    return params not in TPU_FORM_DEFAULT.get(f"{module}::{function}", ())

def is_slow(nodeid: str) -> bool:
    """Whether a test (pytest node id, e.g. ``tests/x.py::test_y[z]``) is in the slow tier: its module, its
    function (every parametrisation) or exactly it is listed."""
    module, _, rest = nodeid.partition("::")
    function = rest.split("[", 1)[0]
    return (module in SLOW or f"{module}::{function}" in SLOW or nodeid in SLOW) or _is_slow_tpu_form(nodeid)
