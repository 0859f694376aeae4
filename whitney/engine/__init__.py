"""Whitney's engine: tensors only (torch + transformers), no HTTP, no database.

Public API:
  Backend                the interface the service drives (backend.py): plain data in and out;
                         InProcessBackend over an Engine; EngineConfig, ModelInfo, Weights, Failure
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

from whitney.engine.backend import Backend, EngineConfig, Failure, InProcessBackend, ModelInfo, Weights
from whitney.engine.datum import Datum, TensorInput
from whitney.engine.lora import LoraConfig
from whitney.engine.losses import LOSS_NAMES
from whitney.engine.losses import describe as describe_losses
from whitney.engine.model import DEFAULT_MODEL
from whitney.engine.optim import AdamParams
from whitney.engine.requests import DatumOutput, ForwardRequest, ForwardResult, merge_results
from whitney.engine.runs import Engine

__all__ = ["AdamParams", "Backend", "DEFAULT_MODEL", "Datum", "DatumOutput", "Engine", "EngineConfig", "Failure",
           "ForwardRequest", "ForwardResult", "InProcessBackend", "LOSS_NAMES", "LoraConfig", "ModelInfo",
           "TensorInput", "Weights", "describe_losses", "merge_results"]
