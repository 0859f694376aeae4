"""A catalogue of malformed and invalid requests against a real server, and what each must answer.

Every rejection is a 4xx JSON body {code, message, field?, datum_index?}: the status and code say what
kind of mistake, `field` names the part of the request at fault, `datum_index` the datum. Never a 5xx.
Each base request the catalogue mutates is shown to be accepted (test_bases_are_accepted), so every
case fails for the one fault it introduces. A rejected request must leave no trace in the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import sqlalchemy as sql

from tests.service.conftest import start_server
from whitney.service.app import ServiceConfig
from whitney.service.scheduling.limits import Limits

VOCAB, CONTEXT, MAX_RANK = 49152, 512, 128
CODES = {400: "invalid_input", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
         409: "conflict", 413: "too_large", 422: "invalid_request"}
TERMINAL = ("succeeded", "failed", "cancelled")


# ---- request builders ------------------------------------------------------------------------

def tensor(values: list, dtype: str = "int64", shape: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": [len(values)] if shape is None else shape, "values": values}


TOKENS, TARGETS = [1, 2, 3, 4], [2, 3, 4, 5]


def ce(tokens=TOKENS, targets=TARGETS, weights=None, **extra) -> dict:
    """A cross_entropy datum; extra loss inputs (or overrides) as keyword arguments."""
    inputs: dict[str, Any] = {"target_tokens": tensor(list(targets))}
    if weights is not None:
        inputs["weights"] = weights if isinstance(weights, dict) else tensor(list(weights), "float32")
    inputs.update(extra)
    return {"input": {"token_ids": list(tokens)}, "loss_inputs": inputs}


def rl(**extra) -> dict:
    """A datum for importance_sampling / ppo / cispo / dro."""
    inputs = {"target_tokens": tensor(TARGETS), "old_logprobs": tensor([-1.0] * 4, "float32"),
              "advantages": tensor([1.0, -1.0, 0.5, 0.0], "float32")}
    inputs.update(extra)
    return {"input": {"token_ids": TOKENS}, "loss_inputs": inputs}


def opsd(**over) -> dict:
    """A valid opsd row: student CE at 0-1, KL pairs at student 2-3 / teacher 2-3 (targets 13, 14)."""
    student = {"tokens": [10, 11, 12, 13, 14], "target_tokens": [11, 12, 13, 14, 0], "loss_mask": [1, 1, 0, 0, 0],
               "kl_mask": [0, 0, 1, 1, 0], "kl_ids": [0, 0, 0, 1, 0], "teacher_token_ids": [20, 21, 12, 13, 14],
               "teacher_target_tokens": [21, 12, 13, 14, 0], "teacher_kl_mask": [0, 0, 1, 1, 0],
               "teacher_kl_ids": [0, 0, 0, 1, 0]}
    student.update(over)
    floats = ("loss_mask", "kl_mask", "teacher_kl_mask")
    inputs = {k: tensor(v, "float32" if k in floats else "int64") for k, v in student.items() if k != "tokens"}
    return {"input": {"token_ids": student["tokens"]}, "loss_inputs": inputs}


def fb(data: list[dict], **kw) -> dict:
    return {"seq_id": 0, "data": data, **kw}


def raw(body: dict, literal: str) -> bytes:
    """JSON text with the string "@" replaced by a literal strict JSON cannot hold (1e999, NaN, a huge int)."""
    return json.dumps(body).replace('"@"', literal).encode()


def text(body: dict) -> bytes:
    """JSON text as json.dumps writes it: a lone surrogate in a string becomes the escape \\udc80."""
    return json.dumps(body).encode()


def on_run(route: str) -> Callable[[SimpleNamespace], str]:
    return lambda c: f"/v1/runs/{c.run}/{route}"


FB, FWD, OPTIM = on_run("forward_backward"), on_run("forward"), on_run("optim_step")
NEW_RUN = lambda c: f"/v1/sessions/{c.session}/runs"  # noqa: E731
SAMPLES, LOGPROBS = (lambda c: "/v1/samples"), (lambda c: "/v1/logprobs")


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: Callable[[SimpleNamespace], str]
    body: Any  # dict, bytes (raw JSON), None, or a function of the context returning one of those
    status: int
    field: str | None  # a substring of the error's field; None: Starlette's own errors carry none
    datum_index: int | None = None


CASES = [
    # -- unknown fields and wrong types: the schema refuses them (422) ----------------------------
    Case("unknown_top_level_field", "POST", FB, fb([ce()], bogus=1), 422, "bogus"),
    Case("unknown_datum_field", "POST", FB, fb([ce(), {**ce(), "extra": 1}]), 422, "data.1.extra", 1),
    Case("unknown_tensor_field", "POST", FB,
         fb([ce(target_tokens={**tensor(TARGETS), "strides": [1]})]), 422, "target_tokens.strides", 0),
    Case("unknown_adam_key", "POST", OPTIM, {"seq_id": 0, "adam_params": {"momentum": 0.9}}, 422,
         "adam_params.momentum"),
    Case("unknown_lora_key", "POST", NEW_RUN, {"lora": {"dropout": 0.1}}, 422, "lora.dropout"),
    Case("unknown_session_field", "POST", lambda c: "/v1/sessions", {"name": "x"}, 422, "name"),
    Case("unknown_sample_field", "POST", SAMPLES, {"prompt": [1], "temperatur": 0.5}, 422, "temperatur"),
    Case("seq_id_not_an_int", "POST", FB, fb([ce()], seq_id="first"), 422, "seq_id"),
    Case("data_not_a_list", "POST", FB, fb({"input": {"token_ids": [1]}}), 422, "data"),
    Case("token_ids_strings", "POST", FB, fb([ce(), ce(tokens=["a", "b", "c", "d"])]), 422, "token_ids", 1),
    Case("token_id_fractional", "POST", FB, fb([ce(tokens=[1.5, 2, 3, 4])]), 422, "token_ids", 0),
    Case("datum_without_input", "POST", FB, fb([{"loss_inputs": {}}]), 422, "data.0.input", 0),
    Case("loss_input_not_an_object", "POST", FB, fb([ce(target_tokens=TARGETS)]), 422, "target_tokens", 0),
    Case("dtype_unknown", "POST", FB, fb([ce(target_tokens=tensor(TARGETS, "int8"))]), 422, "dtype", 0),
    Case("learning_rate_not_a_number", "POST", OPTIM, {"seq_id": 0, "adam_params": {"learning_rate": "fast"}},
         422, "adam_params.learning_rate"),
    Case("user_metadata_not_an_object", "POST", lambda c: "/v1/sessions", {"user_metadata": [1]}, 422,
         "user_metadata"),
    Case("body_not_an_object", "POST", FB, [fb([ce()])], 422, "body"),
    Case("body_not_json", "POST", FB, b'{"seq_id": 0, "data": [', 422, "body"),
    # -- seq_id --------------------------------------------------------------------------------------
    Case("missing_seq_id", "POST", FB, {"data": [ce()]}, 422, "seq_id"),
    Case("negative_seq_id", "POST", FB, fb([ce()], seq_id=-1), 422, "seq_id"),
    Case("seq_id_beyond_int64", "POST", OPTIM, {"seq_id": 2**63}, 422, "seq_id"),
    # -- datums --------------------------------------------------------------------------------------
    Case("empty_data", "POST", FB, fb([]), 422, "data"),
    Case("empty_token_ids", "POST", FB, fb([ce(tokens=[], targets=[])]), 422, "token_ids", 0),
    Case("empty_token_chunks", "POST", FB, fb([ce(), ce(tokens=[[], []], targets=[])]), 422, "token_ids", 1),
    Case("input_token_out_of_vocab", "POST", FB, fb([ce(), ce(tokens=[1, VOCAB, 3, 4])]), 400, "token_ids", 1),
    Case("input_token_negative", "POST", FB, fb([ce(tokens=[1, -1, 3, 4])]), 422, "token_ids", 0),
    Case("input_token_beyond_int64", "POST", FB, fb([ce(), ce(tokens=[1, 2**70, 3, 4])]), 400, "token_ids", 1),
    Case("input_over_context", "POST", FB,
         fb([ce(tokens=[1] * (CONTEXT + 1), targets=[1] * (CONTEXT + 1))]), 400, "token_ids", 0),
    Case("target_token_out_of_vocab", "POST", FB, fb([ce(), ce(), ce(targets=[2, 3, VOCAB + 7, 5])]), 400,
         "target_tokens", 2),
    Case("target_shape_mismatch_at_datum_2", "POST", FB, fb([ce(), ce(), ce(targets=[2, 3, 4, 5, 6])]), 400,
         "target_tokens", 2),
    Case("target_2d_mixed_with_1d", "POST", FB,
         fb([ce(), ce(target_tokens=tensor([2, 9, 3, 9, 4, 9, 5, 9], shape=[4, 2]))]), 400, "target_tokens", 1),
    Case("target_float_values_int_dtype", "POST", FB, fb([ce(target_tokens=tensor([2, 3.5, 4, 5]))]), 400,
         "target_tokens", 0),
    Case("target_float_dtype", "POST", FB, fb([ce(target_tokens=tensor([2.0, 3.0, 4.0, 5.0], "float32"))]), 400,
         "target_tokens", 0),
    Case("values_not_filling_shape", "POST", FB, fb([ce(target_tokens=tensor(TARGETS, shape=[5]))]), 400,
         "target_tokens", 0),
    Case("negative_shape", "POST", FB, fb([ce(target_tokens=tensor(TARGETS, shape=[-4]))]), 422,
         "target_tokens", 0),
    Case("weights_shape_mismatch", "POST", FB, fb([ce(), ce(weights=[1.0, 1.0, 1.0])]), 400, "weights", 1),
    Case("weights_not_matching_2d_targets", "POST", FB,
         fb([ce(target_tokens=tensor([2, 9, 3, 9, 4, 9, 5, 9], shape=[4, 2]), weights=[1.0] * 4)]), 400,
         "weights", 0),
    Case("weights_inf", "POST", FB, raw(fb([ce(weights=[1.0, "@", 1.0, 1.0])]), "1e999"), 400, "weights", 0),
    Case("weights_nan", "POST", FB, raw(fb([ce(), ce(weights=[1.0, "@", 1.0, 1.0])]), "NaN"), 400, "weights", 1),
    Case("advantages_minus_inf", "POST", FB,
         raw(fb([rl(advantages=tensor([1.0, "@", 0.0, 0.0], "float32"))], loss_function="ppo"), "-Infinity"),
         400, "advantages", 0),
    Case("weights_huge_integer", "POST", FB, raw(fb([ce(weights=[1, "@", 1, 1])]), "1" + "0" * 400), 400,
         "weights", 0),
    Case("target_tokens_missing", "POST", FB, fb([{"input": {"token_ids": TOKENS}}]), 400, "target_tokens", 0),
    Case("input_unused_by_loss", "POST", FB, fb([ce(advantages=tensor([1.0] * 4, "float32"))]), 400,
         "advantages", 0),
    Case("advantages_missing_for_ppo", "POST", FB,
         fb([{"input": {"token_ids": TOKENS}, "loss_inputs": {"target_tokens": tensor(TARGETS),
                                                                "old_logprobs": tensor([-1.0] * 4, "float32")}}],
            loss_function="ppo"), 400, "advantages", 0),
    Case("logprobs_and_old_logprobs_both", "POST", FB,
         fb([rl(logprobs=tensor([-1.0] * 4, "float32"))], loss_function="ppo"), 400, "logprobs", 0),
    Case("forward_bad_datum", "POST", FWD, fb([ce(), ce(targets=[2, 3])]), 400, "target_tokens", 1),
    # -- losses and their configs --------------------------------------------------------------------
    Case("unknown_loss_function", "POST", FB, fb([ce()], loss_function="grpo"), 400, "loss_function"),
    Case("unknown_loss_config_key", "POST", FB, fb([ce()], loss_config={"eps": 0.1}), 400, "loss_config.eps"),
    Case("is_takes_no_config", "POST", FB, fb([rl()], loss_function="importance_sampling",
                                              loss_config={"clip_low": 0.1}), 400, "loss_config.clip_low"),
    Case("ppo_clip_low_above_1", "POST", FB, fb([rl()], loss_function="ppo", loss_config={"clip_low": 1.5}),
         400, "loss_config.clip_low"),
    Case("ppo_clip_high_negative", "POST", FB, fb([rl()], loss_function="ppo", loss_config={"clip_high": -0.1}),
         400, "loss_config.clip_high"),
    Case("ppo_clip_high_threshold_below_1", "POST", FB,
         fb([rl()], loss_function="ppo", loss_config={"clip_high_threshold": 0.9}), 400,
         "loss_config.clip_high_threshold"),
    Case("ppo_both_clip_forms", "POST", FB,
         fb([rl()], loss_function="ppo", loss_config={"clip_low": 0.2, "clip_low_threshold": 0.8}), 400,
         "loss_config.clip_low_threshold"),
    Case("ppo_clip_not_a_number", "POST", FB, fb([rl()], loss_function="ppo", loss_config={"clip_low": "wide"}),
         400, "loss_config.clip_low"),
    Case("cispo_eps_max_zero", "POST", FB, fb([rl()], loss_function="cispo", loss_config={"eps_max": 0}), 400,
         "loss_config.eps_max"),
    Case("dro_beta_negative", "POST", FB, fb([rl()], loss_function="dro", loss_config={"beta": -0.1}), 400,
         "loss_config.beta"),
    Case("dro_beta_inf", "POST", FB, raw(fb([rl()], loss_function="dro", loss_config={"beta": "@"}), "1e999"),
         400, "loss_config.beta"),
    Case("dro_beta_huge_integer", "POST", FB,
         raw(fb([rl()], loss_function="dro", loss_config={"beta": "@"}), "1" + "0" * 400), 400, "loss_config.beta"),
    # -- opsd rules (the bad row is datum 1, after a good one) ----------------------------------------
    Case("opsd_coefs_both_zero", "POST", FB,
         fb([opsd()], loss_function="opsd", loss_config={"ce_coef": 0.0, "kl_coef": 0.0}), 400, "loss_config"),
    Case("opsd_coef_negative", "POST", FB, fb([opsd()], loss_function="opsd", loss_config={"ce_coef": -1.0}),
         400, "loss_config.ce_coef"),
    Case("opsd_coef_huge_integer", "POST", FB,
         raw(fb([opsd()], loss_function="opsd", loss_config={"kl_coef": "@"}), "1" + "0" * 400), 400,
         "loss_config.kl_coef"),
    Case("opsd_mask_on_trailing_position", "POST", FB,
         fb([opsd(), opsd(teacher_kl_mask=[0, 0, 1, 1, 1], teacher_kl_ids=[0, 0, 0, 1, 2])], loss_function="opsd"),
         400, "teacher_kl_mask", 1),
    Case("opsd_masks_overlap", "POST", FB,
         fb([opsd(), opsd(loss_mask=[1, 1, 1, 0, 0])], loss_function="opsd"), 400, "loss_mask", 1),
    Case("opsd_kl_ids_not_0_to_k", "POST", FB,
         fb([opsd(), opsd(kl_ids=[0, 0, 0, 2, 0])], loss_function="opsd"), 400, "kl_ids", 1),
    Case("opsd_targets_not_next_tokens", "POST", FB,
         fb([opsd(), opsd(target_tokens=[99, 12, 13, 14, 0])], loss_function="opsd"), 400, "target_tokens", 1),
    Case("opsd_pairs_differ", "POST", FB,
         fb([opsd(), opsd(teacher_token_ids=[20, 21, 12, 13, 15], teacher_target_tokens=[21, 12, 13, 15, 0])],
            loss_function="opsd"), 400, "teacher_target_tokens", 1),
    Case("opsd_pair_count_differs", "POST", FB,
         fb([opsd(), opsd(teacher_kl_mask=[0, 0, 1, 0, 0], teacher_kl_ids=[0, 0, 0, 0, 0])], loss_function="opsd"),
         400, "teacher_kl_mask", 1),
    Case("opsd_ce_without_sft_tokens", "POST", FB,
         fb([opsd(), opsd(loss_mask=[0, 0, 0, 0, 0])], loss_function="opsd"), 400, "loss_mask", 1),
    Case("opsd_teacher_missing", "POST", FB,
         fb([{"input": {"token_ids": [10, 11, 12, 13, 14]},
              "loss_inputs": {k: v for k, v in opsd()["loss_inputs"].items() if k != "teacher_token_ids"}}],
            loss_function="opsd"), 400, "teacher_token_ids", 0),
    # -- optim_step ----------------------------------------------------------------------------------
    Case("learning_rate_zero", "POST", OPTIM, {"seq_id": 0, "adam_params": {"learning_rate": 0.0}}, 422,
         "learning_rate"),
    Case("learning_rate_negative", "POST", OPTIM, {"seq_id": 0, "adam_params": {"learning_rate": -1e-4}}, 422,
         "learning_rate"),
    Case("learning_rate_inf", "POST", OPTIM, raw({"seq_id": 0, "adam_params": {"learning_rate": "@"}}, "1e999"),
         400, "learning_rate"),
    Case("beta1_one", "POST", OPTIM, {"seq_id": 0, "adam_params": {"beta1": 1.0}}, 422, "beta1"),
    Case("beta2_above_one", "POST", OPTIM, {"seq_id": 0, "adam_params": {"beta2": 1.5}}, 422, "beta2"),
    Case("eps_zero", "POST", OPTIM, {"seq_id": 0, "adam_params": {"eps": 0.0}}, 422, "eps"),
    Case("weight_decay_negative", "POST", OPTIM, {"seq_id": 0, "adam_params": {"weight_decay": -0.1}}, 422,
         "weight_decay"),
    Case("gradient_clip_norm_negative", "POST", OPTIM, {"seq_id": 0, "adam_params": {"gradient_clip_norm": -1.0}},
         422, "gradient_clip_norm"),
    Case("gradient_scale_zero", "POST", OPTIM, {"seq_id": 0, "adam_params": {"gradient_scale": 0.0}}, 422,
         "gradient_scale"),
    Case("lora_plus_ratio_negative", "POST", OPTIM, {"seq_id": 0, "adam_params": {"lora_plus_ratio": -2.0}}, 422,
         "lora_plus_ratio"),
    # -- runs and their LoRA ---------------------------------------------------------------------------
    Case("lora_rank_zero", "POST", NEW_RUN, {"lora": {"rank": 0}}, 422, "rank"),
    Case("lora_rank_above_max", "POST", NEW_RUN, {"lora": {"rank": MAX_RANK + 1}}, 400, "rank"),
    Case("lora_alpha_zero", "POST", NEW_RUN, {"lora": {"alpha": 0.0}}, 422, "alpha"),
    Case("lora_unknown_target_module", "POST", NEW_RUN, {"lora": {"target_modules": ["q_proj", "attn_c"]}}, 400,
         "target_modules"),
    Case("lora_empty_target_modules", "POST", NEW_RUN, {"lora": {"target_modules": []}}, 400, "target_modules"),
    Case("lora_nothing_to_train", "POST", NEW_RUN,
         {"lora": {"train_attn": False, "train_mlp": False, "train_unembed": False}}, 400, "train_attn"),
    Case("base_model_not_served", "POST", NEW_RUN, {"base_model": "meta-llama/Llama-3-70B"}, 400, "base_model"),
    Case("resume_from_unknown_checkpoint", "POST", NEW_RUN, {"resume_from": {"checkpoint_id": "pkg-nope"}}, 404,
         "checkpoint_id"),
    Case("resume_from_lora_export", "POST", NEW_RUN, lambda c: {"resume_from": {"checkpoint_id": c.lora_pkg}},
         400, "resume_from.checkpoint_id"),
    Case("resume_with_missing_optimizer", "POST", NEW_RUN,
         lambda c: {"resume_from": {"checkpoint_id": c.noopt_pkg, "with_optimizer": True}}, 400,
         "resume_from.with_optimizer"),
    # -- unknown things (404) ----------------------------------------------------------------------
    Case("unknown_session", "GET", lambda c: "/v1/sessions/ses-nope", None, 404, "session_id"),
    Case("heartbeat_unknown_session", "POST", lambda c: "/v1/sessions/ses-nope/heartbeat", None, 404, "session_id"),
    Case("close_unknown_session", "POST", lambda c: "/v1/sessions/ses-nope/close", None, 404, "session_id"),
    Case("run_in_unknown_session", "POST", lambda c: "/v1/sessions/ses-nope/runs", {}, 404, "session_id"),
    Case("runs_of_unknown_session", "GET", lambda c: "/v1/sessions/ses-nope/runs", None, 404, "session_id"),
    Case("unknown_run", "GET", lambda c: "/v1/runs/run-nope", None, 404, "run_id"),
    Case("forward_backward_unknown_run", "POST", lambda c: "/v1/runs/run-nope/forward_backward", fb([ce()]), 404,
         "run_id"),
    Case("optim_step_unknown_run", "POST", lambda c: "/v1/runs/run-nope/optim_step", {"seq_id": 0}, 404, "run_id"),
    Case("operations_of_unknown_run", "GET", lambda c: "/v1/runs/run-nope/operations", None, 404, "run_id"),
    Case("finish_unknown_run", "POST", lambda c: "/v1/runs/run-nope/finish", None, 404, "run_id"),
    Case("cancel_unknown_run", "POST", lambda c: "/v1/runs/run-nope/cancel", None, 404, "run_id"),
    Case("unknown_operation", "GET", lambda c: "/v1/operations/op-nope", None, 404, "operation_id"),
    Case("unknown_operation_long_poll", "GET", lambda c: "/v1/operations/op-nope?wait=5", None, 404, "operation_id"),
    Case("unknown_checkpoint", "GET", lambda c: "/v1/checkpoints/pkg-nope", None, 404, "checkpoint_id"),
    Case("delete_unknown_checkpoint", "DELETE", lambda c: "/v1/checkpoints/pkg-nope", None, 404, "checkpoint_id"),
    Case("archive_of_unknown_checkpoint", "GET", lambda c: "/v1/checkpoints/pkg-nope/archive", None, 404,
         "checkpoint_id"),
    Case("load_state_unknown_checkpoint", "POST", on_run("load_state"), {"seq_id": 0, "checkpoint_id": "pkg-nope"},
         404, "checkpoint_id"),
    Case("no_such_route", "GET", lambda c: "/v1/no/such/route", None, 404, None),
    Case("wrong_method", "DELETE", lambda c: "/v1/sessions", None, 405, None),
    # -- checkpoints of the wrong kind ---------------------------------------------------------------
    Case("load_state_from_lora_export", "POST", on_run("load_state"),
         lambda c: {"seq_id": 0, "checkpoint_id": c.lora_pkg}, 400, "checkpoint_id"),
    Case("load_state_with_optimizer_without_one", "POST", on_run("load_state_with_optimizer"),
         lambda c: {"seq_id": 0, "checkpoint_id": c.noopt_pkg}, 400, "checkpoint_id"),
    # -- sampling and log-probs ----------------------------------------------------------------------
    Case("sample_empty_prompt", "POST", SAMPLES, {"prompt": []}, 422, "prompt"),
    Case("sample_prompt_token_out_of_vocab", "POST", SAMPLES, {"prompt": [1, VOCAB]}, 400, "prompt"),
    Case("sample_temperature_negative", "POST", SAMPLES, {"prompt": [1], "temperature": -0.5}, 422, "temperature"),
    Case("sample_top_p_zero", "POST", SAMPLES, {"prompt": [1], "top_p": 0.0}, 422, "top_p"),
    Case("sample_top_p_above_one", "POST", SAMPLES, {"prompt": [1], "top_p": 1.5}, 422, "top_p"),
    Case("sample_top_k_below_minus_one", "POST", SAMPLES, {"prompt": [1], "top_k": -2}, 422, "top_k"),
    Case("sample_num_samples_zero", "POST", SAMPLES, {"prompt": [1], "num_samples": 0}, 422, "num_samples"),
    Case("sample_max_tokens_zero", "POST", SAMPLES, {"prompt": [1], "max_tokens": 0}, 422, "max_tokens"),
    Case("sample_beyond_context", "POST", SAMPLES, {"prompt": [1] * (CONTEXT - 10), "max_tokens": 11}, 400,
         "max_tokens"),
    Case("sample_empty_stop", "POST", SAMPLES, {"prompt": [1], "stop": [""]}, 422, "stop"),
    Case("sample_run_and_base_model", "POST", SAMPLES,
         lambda c: {"prompt": [1], "run_id": c.used, "version": 1, "base_model": c.model}, 400, "base_model"),
    Case("sample_run_without_version", "POST", SAMPLES, lambda c: {"prompt": [1], "run_id": c.used}, 400,
         "version"),
    Case("sample_unknown_version", "POST", SAMPLES, lambda c: {"prompt": [1], "run_id": c.used, "version": 99},
         404, "version"),
    Case("sample_unknown_version_of_ended_run", "POST", SAMPLES,
         lambda c: {"prompt": [1], "run_id": c.finished, "version": 1}, 404, "version"),
    Case("sample_version_without_run", "POST", SAMPLES, {"prompt": [1], "version": 1}, 400, "version"),
    Case("sample_unknown_run", "POST", SAMPLES, {"prompt": [1], "run_id": "run-nope", "version": 1}, 404, "run_id"),
    Case("sample_unknown_checkpoint", "POST", SAMPLES, {"prompt": [1], "checkpoint_id": "pkg-nope"}, 404,
         "checkpoint_id"),
    Case("sample_lora_export", "POST", SAMPLES, lambda c: {"prompt": [1], "checkpoint_id": c.lora_pkg}, 400,
         "checkpoint_id"),
    Case("sample_base_model_not_served", "POST", SAMPLES, {"prompt": [1], "base_model": "gpt2"}, 400, "base_model"),
    Case("logprobs_no_sequences", "POST", LOGPROBS, {"sequences": []}, 422, "sequences"),
    Case("logprobs_unknown_version", "POST", LOGPROBS,
         lambda c: {"sequences": [[1, 2]], "run_id": c.used, "version": 2}, 404, "version"),
    Case("logprobs_version_without_run", "POST", LOGPROBS, {"sequences": [[1, 2]], "version": 1}, 400, "version"),
    # -- long-polling --------------------------------------------------------------------------------
    Case("wait_above_30", "GET", lambda c: f"/v1/operations/{c.op}?wait=31", None, 422, "wait"),
    Case("wait_negative", "GET", lambda c: f"/v1/operations/{c.op}?wait=-1", None, 422, "wait"),
    Case("wait_not_a_number", "GET", lambda c: f"/v1/operations/{c.op}?wait=soon", None, 422, "wait"),
    # -- state conflicts (409) -----------------------------------------------------------------------
    Case("forward_backward_on_finished_run", "POST", lambda c: f"/v1/runs/{c.finished}/forward_backward",
         fb([ce()]), 409, "run_id"),
    Case("optim_step_on_cancelled_run", "POST", lambda c: f"/v1/runs/{c.cancelled}/optim_step", {"seq_id": 0},
         409, "run_id"),
    Case("save_state_on_finished_run", "POST", lambda c: f"/v1/runs/{c.finished}/save_state", {"seq_id": 0},
         409, "run_id"),
    Case("finish_finished_run", "POST", lambda c: f"/v1/runs/{c.finished}/finish", None, 409, "run_id"),
    Case("seq_id_reused_with_other_body", "POST", lambda c: f"/v1/runs/{c.used}/forward_backward",
         fb([ce(weights=[0.0, 0.0, 1.0, 1.0])]), 409, "seq_id"),
    Case("seq_id_reused_by_other_kind", "POST", lambda c: f"/v1/runs/{c.used}/optim_step", {"seq_id": 0}, 409,
         "seq_id"),
    Case("load_state_first_on_bound_run", "POST", lambda c: f"/v1/runs/{c.bound}/load_state",
         lambda c: {"seq_id": 0, "checkpoint_id": c.noopt_pkg}, 409, "seq_id"),
    Case("run_in_closed_session", "POST", lambda c: f"/v1/sessions/{c.closed}/runs", {}, 409, "session_id"),
    Case("heartbeat_closed_session", "POST", lambda c: f"/v1/sessions/{c.closed}/heartbeat", None, 409,
         "session_id"),
    # -- package names -------------------------------------------------------------------------------
    Case("save_state_name_with_path", "POST", on_run("save_state"), {"seq_id": 0, "name": "../escape"}, 422, "name"),
    Case("save_state_name_empty", "POST", on_run("save_state"), {"seq_id": 0, "name": ""}, 422, "name"),
    Case("save_state_name_too_long", "POST", on_run("save_state"), {"seq_id": 0, "name": "a" * 201}, 422, "name"),
    Case("save_weights_name_with_space", "POST", on_run("save_weights"), {"seq_id": 0, "name": "my weights"}, 422,
         "name"),
    Case("export_lora_name_with_slash", "POST", on_run("export_lora"), {"seq_id": 0, "name": "a/b"}, 422, "name"),
    Case("sampler_name_empty", "POST", on_run("save_weights_for_sampler"), {"seq_id": 0, "name": ""}, 422, "name"),
    # -- invalid text: refused before any route (a stored lone surrogate broke every later listing) --------
    Case("session_metadata_lone_surrogate", "POST", lambda c: "/v1/sessions",
         text({"user_metadata": {"a": "\udc80"}}), 400, "user_metadata.a"),
    Case("session_metadata_key_lone_surrogate", "POST", lambda c: "/v1/sessions",
         text({"user_metadata": {"ok": 1, "k\ud800": 1}}), 400, "user_metadata.k"),
    Case("run_metadata_lone_surrogate", "POST", NEW_RUN, text({"user_metadata": {"tags": ["ok", "\udfff"]}}), 400,
         "user_metadata.tags.1"),
    Case("loss_input_name_lone_surrogate", "POST", FB,
         text(fb([ce(**{"w\udc80": tensor([1.0] * 4, "float32")})])), 400, "data.0.loss_inputs.w"),
    Case("loss_config_key_lone_surrogate", "POST", FB,
         text(fb([rl()], loss_function="ppo", loss_config={"clip_low\udc80": 0.2})), 400, "loss_config.clip_low"),
    Case("checkpoint_name_lone_surrogate", "POST", on_run("save_state"), text({"seq_id": 0, "name": "c\udc80"}),
         400, "name"),
    Case("checkpoint_id_lone_surrogate", "POST", on_run("load_state"),
         text({"seq_id": 0, "checkpoint_id": "pkg-\udc80"}), 400, "checkpoint_id"),
    Case("sample_run_id_lone_surrogate", "POST", SAMPLES, text({"prompt": [1], "run_id": "\ud800", "version": 1}),
         400, "run_id"),
    Case("sample_stop_lone_surrogate", "POST", SAMPLES, text({"prompt": [1], "stop": ["x", "\udc80"]}), 400,
         "stop.1"),
    Case("body_invalid_utf8", "POST", lambda c: "/v1/sessions", b'{"user_metadata": {"a": "\xff"}}', 400, "body"),
    Case("body_utf8_encoded_surrogate", "POST", NEW_RUN, b'{"user_metadata": {"a": "\xed\xb2\x80"}}', 400,
         "body"),
    Case("body_invalid_utf8_not_declared_json", "POST", lambda c: "/v1/sessions", b"\xff\xfe{}", 400, "body"),
    Case("path_percent_encoded_surrogate", "GET", lambda c: "/v1/runs/%ED%B2%80", None, 404, "run_id"),
    Case("path_percent_encoded_invalid_utf8", "GET", lambda c: "/v1/checkpoints/%FF%FE/archive", None, 404,
         "checkpoint_id"),
    Case("query_percent_encoded_surrogate", "GET", lambda c: f"/v1/operations/{c.op}?wait=%ED%B2%80", None, 422,
         "wait"),
    # -- sampling parameters the batch could not run (a failure there failed every sample in flight) -------
    Case("sample_top_k_above_vocab", "POST", SAMPLES, {"prompt": [1], "top_k": VOCAB + 1}, 400, "top_k"),
    # -- tensor sizes: K of an [N, K] soft target is bounded (protocol.training.MAX_K), so are the dimensions ----------
    Case("soft_targets_k_above_max", "POST", FB, fb([ce(target_tokens=tensor([2] * 4 * 257, shape=[4, 257]))]), 400,
         "target_tokens", 0),
    Case("tensor_three_dims", "POST", FB, fb([ce(target_tokens=tensor(TARGETS, shape=[4, 1, 1]))]), 400,
         "target_tokens", 0),
]


# ---- the server and the state the catalogue needs -------------------------------------------------

@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama):
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path_factory.mktemp("errors") / "data"))
    yield server
    server.stop()


def settle(http, op: dict) -> dict:
    """Long-poll an operation until it is terminal."""
    deadline = time.time() + 60
    while op["status"] not in TERMINAL:
        assert time.time() < deadline, op
        op = http.get(f"/v1/operations/{op['id']}", params={"wait": 10}).json()
    return op


def succeeded(http, response) -> dict:
    assert response.status_code == 202, response.text
    op = settle(http, response.json())
    assert op["status"] == "succeeded", op
    return op


def run_reaches(http, run_id: str, status: str) -> None:
    deadline = time.time() + 30
    while http.get(f"/v1/runs/{run_id}").json()["status"] != status:
        assert time.time() < deadline, http.get(f"/v1/runs/{run_id}").json()
        time.sleep(0.05)


def new_run(http, session: str, **body) -> str:
    r = http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 4}, **body})
    assert r.status_code == 201, r.text
    return r.json()["id"]


@pytest.fixture(scope="module")
def ctx(srv, tiny_llama) -> SimpleNamespace:
    """An active session and run (no operations), a run with used seq_ids and packages, ended runs."""
    with srv.http() as http:
        session = http.post("/v1/sessions", json={}).json()["id"]
        run, used = new_run(http, session), new_run(http, session)
        op = succeeded(http, http.post(f"/v1/runs/{used}/forward_backward", json=fb([ce()])))
        lora_pkg = succeeded(http, http.post(f"/v1/runs/{used}/export_lora", json={"seq_id": 1}))
        noopt_pkg = succeeded(http, http.post(f"/v1/runs/{used}/save_state",
                                              json={"seq_id": 2, "include_optimizer": False}))
        version = succeeded(http, http.post(f"/v1/runs/{used}/save_weights_for_sampler", json={"seq_id": 3}))
        assert version["result"]["version"] == 1
        bound = new_run(http, session, resume_from={"checkpoint_id": noopt_pkg["result"]["package"]["id"]})
        finished, cancelled = new_run(http, session), new_run(http, session)
        assert http.post(f"/v1/runs/{finished}/finish").status_code == 200
        assert http.post(f"/v1/runs/{cancelled}/cancel").status_code == 200
        run_reaches(http, finished, "finished")
        run_reaches(http, cancelled, "cancelled")
        closed = http.post("/v1/sessions", json={}).json()["id"]
        assert http.post(f"/v1/sessions/{closed}/close").json()["status"] == "closed"
    return SimpleNamespace(session=session, run=run, used=used, op=op["id"], model=tiny_llama, bound=bound,
                           lora_pkg=lora_pkg["result"]["package"]["id"], finished=finished, cancelled=cancelled,
                           noopt_pkg=noopt_pkg["result"]["package"]["id"], closed=closed)


def send(http, method: str, path: str, body: Any):
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"content-type": "application/json"})
    if body is None:
        return http.request(method, path)
    return http.request(method, path, json=body)


def assert_error(response, status: int, field: str | None, datum_index: int | None) -> dict:
    assert response.status_code < 500, f"a server error for a caller's mistake: {response.text}"
    assert response.status_code == status, response.text
    err = response.json()
    assert err.get("code") == CODES[status], err
    assert isinstance(err.get("message"), str) and err["message"], err
    if field is not None:
        assert field in (err.get("field") or ""), err
    assert err.get("datum_index") == datum_index, err
    return err


# ---- the catalogue -------------------------------------------------------------------------------

def test_catalogue_is_large_and_distinct():
    assert len(CASES) >= 35
    assert len({c.id for c in CASES}) == len(CASES)


def snapshot(server) -> dict:
    """Every row a request could have added or changed, read straight from the server's database."""
    with server.app.state.whitney.store.engine.connect() as db:
        return {table: sorted(tuple(row) for row in db.execute(sql.text(f"SELECT id, {column} FROM {table}")))
                for table, column in (("sessions", "status"), ("runs", "status"), ("operations", "status"),
                                      ("model_packages", "deleted"))}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rejected(case: Case, srv, ctx):
    """The error names the fault, and the rejected request left nothing behind (no run, operation, package)."""
    body = case.body(ctx) if callable(case.body) else case.body
    with srv.http() as http:
        before = snapshot(srv)
        assert_error(send(http, case.method, case.path(ctx), body), case.status, case.field, case.datum_index)
        assert snapshot(srv) == before


def test_the_clean_run_took_no_operation(srv, ctx):
    with srv.http() as http:
        assert [c.id for c in CASES if c.path(ctx).startswith(f"/v1/runs/{ctx.run}/")]  # many were aimed at it
        assert http.get(f"/v1/runs/{ctx.run}/operations").json() == []
        assert http.get(f"/v1/runs/{ctx.run}").json()["status"] == "active"


BASES = [  # (what, route, body): each is what one or more catalogue cases mutate, and it is accepted
    ("cross_entropy", "forward", fb([ce(), ce(weights=[0.0, 1.0, 1.0, 1.0]), ce()])),
    ("soft_targets", "forward", fb([ce(target_tokens=tensor([2, 9, 3, 9, 4, 9, 5, 9], shape=[4, 2]),
                                       weights=tensor([0.5] * 8, "float32", [4, 2]))])),
    ("ppo", "forward", fb([rl()], loss_function="ppo", loss_config={"clip_low": 0.2, "clip_high": 0.3})),
    ("ppo_thresholds", "forward", fb([rl()], loss_function="ppo",
                                     loss_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})),
    ("cispo", "forward", fb([rl()], loss_function="cispo", loss_config={"eps_max": 2.0})),
    ("dro", "forward", fb([rl()], loss_function="dro", loss_config={"beta": 0.1})),
    ("importance_sampling", "forward", fb([rl()], loss_function="importance_sampling")),
    ("opsd", "forward", fb([opsd(), opsd()], loss_function="opsd", loss_config={"ce_coef": 1.0, "kl_coef": 0.5})),
    ("opsd_kl_only", "forward", fb([opsd(loss_mask=[0] * 5)], loss_function="opsd", loss_config={"ce_coef": 0.0})),
    ("optim_step", "optim_step", {"seq_id": 0, "adam_params": {"learning_rate": 1e-3, "beta1": 0.0,
                                                                "gradient_clip_norm": 1.0}}),
    ("save_state", "save_state", {"seq_id": 0, "name": "good.name-1_x"}),
    ("load_state", "load_state", None),  # the no-optimizer state, loaded without optimizer
]


def test_bases_are_accepted(srv, ctx):
    """Submitted in order on one run (seq_id 0, 1, ...), every base succeeds."""
    with srv.http() as http:
        run = new_run(http, ctx.session)
        ops = []
        for seq_id, (what, route, body) in enumerate(BASES):
            body = body or {"checkpoint_id": ctx.noopt_pkg}
            r = http.post(f"/v1/runs/{run}/{route}", json={**body, "seq_id": seq_id})
            assert r.status_code == 202, (what, r.text)
            ops.append((what, r.json()))
        for what, op in ops:
            op = settle(http, op)
            assert op["status"] == "succeeded" and op["kind"] == route_of(what), (what, op)


def route_of(what: str) -> str:
    return next(route for name, route, _ in BASES if name == what)


def test_bases_of_runs_and_sampling_are_accepted(srv, ctx):
    with srv.http() as http:
        for lora in ({"rank": MAX_RANK, "alpha": 16.0}, {"rank": 2, "target_modules": ["q_proj", "lm_head"]},
                     {"rank": 2, "train_attn": False, "train_mlp": False}):
            assert http.post(f"/v1/sessions/{ctx.session}/runs", json={"lora": lora}).status_code == 201, lora
        assert http.post(f"/v1/sessions/{ctx.session}/runs",
                         json={"resume_from": {"checkpoint_id": ctx.noopt_pkg}}).status_code == 201
        for body in ({"prompt": [1] * (CONTEXT - 10), "max_tokens": 10, "temperature": 0.0, "top_p": 1.0},
                     {"prompt": [VOCAB - 1], "max_tokens": 2, "top_k": -1, "top_p": 0.5, "num_samples": 2,
                      "stop": ["x", 5, [6, 7]]},
                     {"prompt": [1, 2], "max_tokens": 2, "run_id": ctx.used, "version": 1},
                     {"prompt": [1, 2], "max_tokens": 2, "base_model": ctx.model}):
            op = succeeded(http, http.post("/v1/samples", json=body))
            assert len(op["result"]["sequences"]) == body.get("num_samples", 1), body
        op = succeeded(http, http.post("/v1/logprobs", json={"sequences": [[1, 2, 3]], "run_id": ctx.used,
                                                             "version": 1}))
        assert len(op["result"]["logprobs"][0]) == 3
        assert http.get(f"/v1/operations/{ctx.op}", params={"wait": 30}).status_code == 200


# ---- retries, limits, keys ---------------------------------------------------------------------------

def test_a_retry_with_the_same_body_is_not_a_conflict(srv, ctx):
    """The 409 for a reused seq_id is about a different body: the same body returns the first operation,
    on an active run and on one that has finished since (the retry is answered, not a 404 or a 409)."""
    with srv.http() as http:
        r = http.post(f"/v1/runs/{ctx.used}/forward_backward", json=fb([ce()]))
        assert r.status_code == 202 and r.json()["id"] == ctx.op, r.text
        run = new_run(http, ctx.session)
        first = succeeded(http, http.post(f"/v1/runs/{run}/forward", json=fb([ce()])))
        step = succeeded(http, http.post(f"/v1/runs/{run}/optim_step", json={"seq_id": 1}))
        assert http.post(f"/v1/runs/{run}/finish").status_code == 200
        run_reaches(http, run, "finished")
        for route, body, op in (("forward", fb([ce()]), first), ("optim_step", {"seq_id": 1}, step)):
            r = http.post(f"/v1/runs/{run}/{route}", json=body)
            assert r.status_code == 202 and r.json()["id"] == op["id"] and r.json()["status"] == "succeeded", r.text
        assert_error(http.post(f"/v1/runs/{run}/forward", json=fb([ce(), ce()])), 409, "seq_id", None)
        assert_error(http.post(f"/v1/runs/{run}/forward", json=fb([ce()], seq_id=2)), 409, "run_id", None)


def test_body_over_the_limit_is_413(make_server):
    server = make_server(limits=Limits(max_request_bytes=1000))
    small = {"user_metadata": {"note": "x" * 800}}
    big = {"user_metadata": {"note": "x" * 1200}}
    with server.http() as http:
        assert http.post("/v1/sessions", json=small).status_code == 201
        assert_error(http.post("/v1/sessions", json=big), 413, "body", None)
        # Without a content-length (chunked), the limit still holds, and a small chunked body still passes.
        chunks = lambda body: iter([json.dumps(body).encode()[:500], json.dumps(body).encode()[500:]])  # noqa: E731
        err = assert_error(http.post("/v1/sessions", content=chunks(big),
                                     headers={"content-type": "application/json"}), 413, "body", None)
        assert "1000" in err["message"]
        r = http.post("/v1/sessions", content=chunks(small), headers={"content-type": "application/json"})
        assert r.status_code == 201 and r.json()["user_metadata"] == small["user_metadata"], r.text
        assert len(http.get("/v1/sessions").json()) == 2  # the refused ones created nothing


def test_missing_or_wrong_api_key_is_401(make_server):
    server = make_server(api_keys=["k-right"])
    with server.http() as anonymous, server.http("k-wrong") as wrong, server.http("k-right") as right:
        assert_error(anonymous.post("/v1/sessions", json={}), 401, "authorization", None)
        assert_error(wrong.get("/v1/sessions"), 401, "authorization", None)
        assert right.post("/v1/sessions", json={}).status_code == 201


# ---- a rejected request corrupts nothing -----------------------------------------------------------

def test_a_rejected_request_leaves_no_gradient_and_no_seq_id(srv, ctx):
    """Rejected forward_backward (a bad datum after a good one) and optim_step calls, then the valid ones
    under the same seq_ids: the gradient norm and the weights after the step equal a clean run's."""
    good = fb([ce(), ce(tokens=[5, 6, 7, 8], targets=[6, 7, 8, 9], weights=[0.0, 1.0, 1.0, 1.0])])
    bad = fb([good["data"][0], ce(targets=[2, 3, VOCAB, 5])])
    step = {"seq_id": 1, "adam_params": {"learning_rate": 0.05}}
    probe = fb([ce(tokens=[9, 8, 7, 6], targets=[8, 7, 6, 5])], seq_id=2)

    def train(http, run: str, reject: bool) -> tuple[float, float]:
        if reject:
            assert_error(http.post(f"/v1/runs/{run}/forward_backward", json=bad), 400, "target_tokens", 1)
            assert_error(http.post(f"/v1/runs/{run}/forward_backward", json={**good, "loss_function": "ppo"}), 400,
                         "advantages", 0)
        fwd = succeeded(http, http.post(f"/v1/runs/{run}/forward_backward", json=good))
        if reject:
            assert_error(http.post(f"/v1/runs/{run}/optim_step", json={**step, "adam_params": {"beta1": 1.0}}),
                         422, "beta1", None)
            assert_error(http.post(f"/v1/runs/{run}/optim_step", json={"seq_id": 1, "adam_params": {"lr": 1}}),
                         422, "adam_params.lr", None)
        metrics = succeeded(http, http.post(f"/v1/runs/{run}/optim_step", json=step))["result"]["metrics"]
        after = succeeded(http, http.post(f"/v1/runs/{run}/forward", json=probe))["result"]["loss"]
        assert [op["seq_id"] for op in http.get(f"/v1/runs/{run}/operations").json()] == [0, 1, 2]
        assert fwd["result"]["loss"] > 0
        return metrics["grad_norm"], after

    with srv.http() as http:
        rejected = train(http, new_run(http, ctx.session), reject=True)
        clean = train(http, new_run(http, ctx.session), reject=False)
        untrained = succeeded(http, http.post(f"/v1/runs/{new_run(http, ctx.session)}/forward",
                                              json={**probe, "seq_id": 0}))["result"]["loss"]
    assert rejected[0] > 0
    assert rejected[0] == pytest.approx(clean[0], rel=1e-6)
    assert rejected[1] == pytest.approx(clean[1], rel=1e-6)
    assert rejected[1] != pytest.approx(untrained, rel=1e-6)  # the step did move the weights


# ---- invalid text already stored, restarts, crash leftovers, one failing sample ---------------------

def test_stored_invalid_text_cannot_break_a_listing(make_server):
    """Rows written before the edge check could hold lone surrogates (escaped in the JSON text); they read
    back with U+FFFD, so listings answer 200, before and after a restart."""
    server = make_server()
    with server.http() as http:
        session = http.post("/v1/sessions", json={"user_metadata": {"a": "ok"}}).json()["id"]
        run = new_run(http, session, user_metadata={"b": "ok"})
    with server.app.state.whitney.store.engine.begin() as db:
        for table, row in (("sessions", session), ("runs", run)):
            db.execute(sql.text(f"UPDATE {table} SET user_metadata = :m WHERE id = :id"),
                       {"m": '{"a\\udc80": ["\\ud800x", "\\ud83d\\ude00"]}', "id": row})
    want = {"a\ufffd": ["\ufffdx", "\U0001F600"]}  # a valid pair stays the character it encodes
    for attempt in range(2):
        with server.http() as http:
            for path in ("/v1/sessions", f"/v1/sessions/{session}/runs"):
                r = http.get(path)
                assert r.status_code == 200, (attempt, path, r.text)
                assert r.json()[0]["user_metadata"] == want, r.json()
            for path in (f"/v1/sessions/{session}", f"/v1/runs/{run}", f"/api/v1/training_runs/{run}"):
                assert http.get(path).status_code == 200, (attempt, path)
            assert http.get("/api/v1/training_runs").status_code == 200
        server.stop()
        server = make_server()  # the same data directory


def test_failed_operations_after_a_restart_carry_category(make_server):
    """An operation cut off by a restart fails with code server_restarted and category server (the Tinker
    future says so too), like every other failed operation."""
    server = make_server()
    with server.http() as http:
        run = new_run(http, http.post("/v1/sessions", json={}).json()["id"])
        queued = http.post(f"/v1/runs/{run}/optim_step", json={"seq_id": 1}).json()  # seq_id 0 never comes
        assert queued["status"] == "queued"
    server.stop()
    with make_server().http() as http:
        op = http.get(f"/v1/operations/{queued['id']}").json()
        assert op["status"] == "failed", op
        assert op["error"]["code"] == "server_restarted" and op["error"]["category"] == "server", op
        future = http.post("/api/v1/retrieve_future", json={"request_id": queued["id"]}).json()
        assert future["category"] == "server", future


def test_crash_leftovers_are_removed_at_startup(make_server):
    """A process killed inside atomic_dir (save_weights with merge=True writes hundreds of MB) leaves
    `.{name}.tmp-*` beside the packages; the next start removes them and keeps every real checkpoint."""
    server = make_server()
    with server.http() as http:
        run = new_run(http, http.post("/v1/sessions", json={}).json()["id"])
        package = succeeded(http, http.post(f"/v1/runs/{run}/save_state", json={"seq_id": 0}))["result"]["package"]
    server.stop()
    packages = server.config.data_dir / "packages"
    leftovers = [packages / ".pkg-0123456789abcdef.tmp-x1y2z3", packages / ".pkg-fedcba9876543210.tmp-abc"]
    for d in leftovers:
        (d / "nested").mkdir(parents=True)
        (d / "nested" / "model.safetensors").write_bytes(b"\0" * 1024)
    kept = sorted(p.name for p in packages.iterdir() if p not in leftovers)
    assert kept, "the saved state is not under data_dir/packages"
    server = make_server()
    assert not any(d.exists() for d in leftovers), "half-written checkpoints survived the restart"
    assert sorted(p.name for p in packages.iterdir()) == kept
    with server.http() as http:
        run = new_run(http, http.post("/v1/sessions", json={}).json()["id"])
        succeeded(http, http.post(f"/v1/runs/{run}/load_state", json={"seq_id": 0, "checkpoint_id": package["id"]}))


def test_one_failing_sample_fails_alone(srv, monkeypatch):
    """A sample whose own next-token choice raises fails (code internal, category server); the samples in
    flight with it succeed with the tokens they get alone, and the server samples on."""
    from whitney.engine.sampling import sampler

    real = sampler.next_tokens

    def next_tokens(logits, rows, u):
        if any(r.request.params.seed == 666 for r in rows):
            raise RuntimeError("injected failure")
        return real(logits, rows, u)

    good = [{"prompt": [1, 2, 3], "max_tokens": 12, "temperature": 1.0, "seed": s, "stop": []} for s in (1, 2)]
    with srv.http() as http:
        alone = [succeeded(http, http.post("/v1/samples", json=b))["result"]["sequences"] for b in good]
        monkeypatch.setattr(sampler, "next_tokens", next_tokens)
        ops = [http.post("/v1/samples", json=b).json() for b in (good[0], {**good[0], "seed": 666}, good[1])]
        done = [settle(http, op) for op in ops]
        assert done[1]["status"] == "failed", done[1]
        assert done[1]["error"]["code"] == "internal" and done[1]["error"]["category"] == "server", done[1]
        assert [d["status"] for d in (done[0], done[2])] == ["succeeded", "succeeded"], done
        for d, ref in zip((done[0], done[2]), alone):
            (seq,), (want,) = d["result"]["sequences"], ref
            assert seq["tokens"] == want["tokens"] and seq["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
        monkeypatch.undo()
        again = succeeded(http, http.post("/v1/samples", json=good[1]))["result"]["sequences"]
        assert again[0]["tokens"] == alone[1][0]["tokens"]


def test_schema_errors_name_the_field_not_pydantic_type_tags(srv, ctx):
    """A violation inside a union (`token_ids` is ints or chunks) names the request's own path."""
    with srv.http() as http:
        err = assert_error(http.post(f"/v1/runs/{ctx.run}/forward_backward", json=fb([ce(), ce(tokens=[1, -1, 3, 4])])),
                           422, None, 1)
        assert err["field"] == "data.1.input.token_ids.1", err
        err = assert_error(http.post(f"/v1/runs/{ctx.run}/forward_backward",
                                     json=fb([ce(weights=tensor([True, False, True, True], "float32"))])), 422, None, 0)
        assert err["field"] == "data.0.loss_inputs.weights.values.0", err
