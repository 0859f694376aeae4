"""Whitney's engine: tensors only (torch + transformers), no HTTP, no database.

Public API (with the plain data of whitney/protocol that its calls take and return):
  Backend, EngineConfig, ModelInfo, Weights, Failure   the protocol (whitney/protocol); InProcessBackend, the
                         Backend over an Engine in this process, is whitney/backends/in_process.py
  Engine                 base models and runs; forward, forward_backward, run_batch, optim_step,
                         compute_logprobs, save_weights_for_sampler, save_state, load_state,
                         export_lora, save_weights
  Datum, TensorInput     one sequence and its named per-token tensors (plain lists)
  ForwardRequest         one run's forward/forward_backward call inside a mixed batch
  ForwardResult          loss (summed), metrics, per-datum log-probs and per-token loss
  merge_results          one request's result from its micro-batches' results
  LoraConfig, AdamParams run and optimizer hyperparameters
  LOSS_NAMES             cross_entropy, importance_sampling, ppo, cispo, dro, gspo, opsd, custom (a graph)
  describe_losses        the loss table (losses.py) as plain data: inputs, config keys and defaults

Shape legend used throughout: B rows (datums) of a batch, T padded positions, N tokens of a datum,
K soft-target candidates per position, M teacher-stream tokens (opsd), D hidden size, V vocabulary,
r LoRA rank. Losses are summed over tokens, never averaged (opsd: summed over rows of per-row means).
"""

from whitney.engine.losses.builtin import LOSS_NAMES
from whitney.engine.losses.builtin import describe as describe_losses
from whitney.engine.training.runs import Engine
from whitney.protocol.backend import Backend, Failure, ModelInfo, Weights
from whitney.protocol.config import DEFAULT_MODEL, EngineConfig
from whitney.protocol.training import (AdamParams, Datum, DatumOutput, ForwardRequest, ForwardResult, LoraConfig,
                                       TensorInput, merge_results)

__all__ = ["AdamParams", "Backend", "DEFAULT_MODEL", "Datum", "DatumOutput", "Engine", "EngineConfig", "Failure",
           "ForwardRequest", "ForwardResult", "LOSS_NAMES", "LoraConfig", "ModelInfo",
           "TensorInput", "Weights", "describe_losses", "merge_results"]
