"""The official Tinker SDK's tests, collected again against a server on `--backend ray` (one sampler replica):
tests/tinker/test_training.py and test_sampling.py, unchanged, over this directory's `tinker_server`."""

from __future__ import annotations

from tests.tinker.test_sampling import (  # noqa: F401
    test_base_model_sampling_client,
    test_compute_logprobs_matches_native,
    test_max_tokens_none_samples_to_the_end_of_the_context,
    test_sample_with_every_parameter_matches_native,
    test_sampler_handle_and_pickle,
    test_sampling_an_unknown_path_is_a_user_error,
    test_save_weights_and_get_sampling_client,
    test_stop_tokens_strings_and_no_eos,
    test_unsupported_sampling_fields_are_refused,
    trained,
)
from tests.tinker.test_training import (  # noqa: F401
    native,
    test_create_lora_training_client_and_info,
    test_forward_backward_and_optim_step_match_native,
    test_forward_backward_custom_matches_native,
    test_soft_targets_2d_sparse,
    test_state_round_trip,
    test_user_errors_fail_their_future_and_do_not_block_later_requests,
)
