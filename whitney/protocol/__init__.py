"""What crosses the boundary between the service and a backend, torch-free: the control plane (and the
`whitney` command's help) imports this package without loading torch or the engine.

  config.py    EngineConfig (every engine default, once), DEFAULT_MODEL, served names, usable CPUs
  training.py  datums and their tensors, ForwardRequest / ForwardResult (and merge_results), LoraConfig,
               AdamParams, the loss metrics' reductions
  sampling.py  SamplingParams and their checks, SampleResult, SampleProgress
  backend.py   the Backend protocol (with Tokenizers and Housekeeping: ServedBackend), BackendSpec, ModelInfo,
               Weights, Failure, PackageKind, Residency, ChatTokens
  files.py     checkpoint directories written whole (atomic_dir) and half-written ones removed at start
"""
