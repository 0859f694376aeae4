"""Write docs/MODELS.md: every causal-LM model type of the installed transformers, served through Whitney.

    HF_HUB_OFFLINE=1 python scripts/model_support.py            # every type (a few minutes), writes the doc
    HF_HUB_OFFLINE=1 python scripts/model_support.py mistral gpt2   # these types only, printed, no doc
    HF_HUB_OFFLINE=1 python scripts/model_support.py --update bart  # re-check these rows of the doc in place

For each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: a tiny random model is built offline from
the config class's defaults, shrunk (2 layers, hidden 64, 4 heads of 16, MLP 128, 4 experts of 32, the
SmolLM2 tokenizer's 49152-token vocabulary; per-layer lists cut to 2 layers, one of each layer kind
kept), with its weights scaled up as in the tests (so logits are not near-uniform), and saved with the
SmolLM2 tokenizer. Whitney then serves the saved directory: `load_base_model` (loading, the general
path's self-checks), base log-probs against the model's own forward (atol 1e-4), a LoRA rank-2 run's
forward_backward + optim_step (finite, non-zero gradients), and greedy sampling of the base model
against HF `generate` (4 tokens). Each type runs in its own forked process with a timeout, two at a time.

A row says: fast path (the hand-written decoder, model.SUPPORTED_TYPES), general path (tested family:
general.TESTED_TYPES, each with its own tests), general path (works, untested: every check above
passes), refused (the clear InvalidInput Whitney answers, as `whitney serve` would), fails (loaded
but a later check failed: a bug or an unserved feature, with the stage and error), or skipped (no tiny
model could be built offline, with the reason).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DOC = ROOT / "docs" / "MODELS.md"
TIMEOUT_S = 180
JOBS = 2
FAST, TESTED, WORKS = "fast path", "general path (tested family)", "general path (works, untested)"
REFUSED, FAILS, SKIPPED = "refused", "fails", "skipped"
# Tiny geometry: attribute (or alias) -> value, set where the config has the attribute.
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
SHRINK = {
    ("hidden_size", "n_embd", "d_model"): 64,
    ("num_attention_heads", "n_head", "decoder_attention_heads", "encoder_attention_heads"): 4,
    ("num_key_value_heads",): 2,
    ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim"): 128,
    ("moe_intermediate_size", "expert_intermediate_size"): 32,
    ("shared_expert_intermediate_size",): 64,
    ("num_experts", "num_local_experts", "n_routed_experts"): 4,
    ("num_experts_per_tok", "moe_topk"): 2,
    ("n_shared_experts", "num_shared_experts"): 1,
    ("n_group", "topk_group"): 1,
    ("linear_num_key_heads",): 2,
    ("linear_num_value_heads",): 4,
    ("linear_key_head_dim", "linear_value_head_dim"): 16,
    ("kv_lora_rank", "q_lora_rank"): 32,
    ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"): 16,
    ("vocab_size", "decoder_vocab_size"): 49152,
}
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _shrink(cfg) -> None:
    """Shrink one config in place (see SHRINK); per-layer lists cut to the new layer count."""
    old = next((getattr(cfg, a) for a in LAYERS if isinstance(getattr(cfg, a, None), int)), None)
    for a in LAYERS:
        if isinstance(getattr(cfg, a, None), int):
            _set(cfg, a, 2)
    for names, value in SHRINK.items():
        for a in names:
            if isinstance(getattr(cfg, a, None), int) and not isinstance(getattr(cfg, a), bool):
                _set(cfg, a, value)
    if hasattr(cfg, "head_dim"):  # also where the default is None (some families read it as is)
        _set(cfg, "head_dim", 16)
    if isinstance(getattr(cfg, "kv_lora_rank", None), int):  # multi-head latent attention: no key/value groups
        _set(cfg, "num_key_value_heads", 4)
        _set(cfg, "qk_head_dim", 32)  # qk_nope_head_dim + qk_rope_head_dim
    for a, value in TOKENS.items():
        if hasattr(cfg, a):
            setattr(cfg, a, value)
    if old:
        for a, v in list(vars(cfg).items()):
            if isinstance(v, list) and len(v) == old and old > 2:
                if a == "layer_types":  # one layer of each kind, in order of first appearance
                    kinds = list(dict.fromkeys(v))[:2]
                    setattr(cfg, a, (kinds * 2)[:2])
                else:
                    setattr(cfg, a, v[:2])


def _set(cfg, name: str, value) -> None:
    try:
        setattr(cfg, name, value)
    except (AttributeError, TypeError, ValueError):  # a derived property, or a per-layer attribute
        pass


def tiny_config(model_type: str):
    """The config class's defaults for `model_type`, shrunk, sub-configs (text, vision, ...) too."""
    from transformers import AutoConfig, PretrainedConfig

    cfg = AutoConfig.for_model(model_type)
    _shrink(cfg)
    for a, v in list(vars(cfg).items()):
        if isinstance(v, PretrainedConfig):
            _shrink(v)
    return cfg


def build(model_type: str, out: Path):
    """Save a tiny random model of `model_type` with the SmolLM2 tokenizer to `out`, after one forward of its own;
    return the HF model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.is_floating_point():
                p.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.12)
    with torch.no_grad():  # a config the shrinking made inconsistent fails here, in transformers itself
        model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]))
    model.save_pretrained(out)
    _tokenizer().save_pretrained(out)
    return model


_TOKENIZER = []


def _tokenizer():
    """The SmolLM2 tokenizer, loaded once (before forking, in run_all)."""
    from transformers import AutoTokenizer

    from whitney.engine.families.model import embedded_model_dir

    if not _TOKENIZER:
        _TOKENIZER.append(AutoTokenizer.from_pretrained(embedded_model_dir()))
    return _TOKENIZER[0]


def check_type(model_type: str) -> dict:
    """Build, serve and check one model type; the row: {type, class, support, detail}."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from whitney.engine import Datum, Engine, LoraConfig
    from whitney.engine.families.general import TESTED_TYPES
    from whitney.engine.families.lora import adaptable_short_names
    from whitney.engine.families.model import SUPPORTED_TYPES, load_base_model
    from whitney.errors import InvalidInput, NotFound
    from whitney.protocol.sampling import SamplingParams

    row = {"type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?")}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / model_type
        try:
            hf = build(model_type, path)
        except Exception as e:
            return row | {"support": SKIPPED, "detail": f"no tiny model offline: {_first_line(e)}"}
        try:
            base = load_base_model(str(path))
        except (InvalidInput, NotFound) as e:
            return row | {"support": REFUSED, "detail": str(e)}
        except Exception as e:
            return row | {"support": FAILS, "detail": f"load: {_first_line(e)}"}
        stage = "log-probs"
        try:
            engine = Engine(device="cpu", compute_dtype="float32")
            engine.models[str(path)] = base
            g = torch.Generator().manual_seed(1)
            seq = torch.randint(100, 49152, (12,), generator=g).tolist()
            ours = torch.tensor(engine.compute_logprobs([seq], base_model=str(path))[0][1:], dtype=torch.float64)
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([seq[:-1]])).logits[0].double()
            theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            diff = float((ours - theirs).abs().max())
            if not diff <= 1e-4:
                return row | {"support": FAILS, "detail": f"log-probs differ from the model's own forward by {diff:.2g}"}
            stage = "forward_backward"
            engine.create_run("r", str(path), LoraConfig(rank=2, alpha=4.0, seed=0))
            with torch.no_grad():
                for b in engine.get_run("r").adapter.B.values():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.05)
            result = engine.forward_backward("r", [Datum(seq[:-1], {"target_tokens": seq[1:]})])
            grads = engine.get_run("r").grads
            if not (torch.isfinite(torch.tensor(result.loss)) and all(torch.isfinite(x).all() for x in grads.values())
                    and all(float(x.abs().max()) > 0 for x in grads.values())):
                return row | {"support": FAILS, "detail": "forward_backward: a gradient is zero or not finite"}
            engine.optim_step("r", {"learning_rate": 1e-3})
            stage = "sampling"
            version = engine.save_weights_for_sampler("r")
            out = engine.sample(seq[:5], SamplingParams(max_tokens=4, seed=0, num_samples=2, stop=()), run_id="r",
                                version=version)
            assert [len(s.tokens) for s in out.sequences] == [4, 4]
            greedy = engine.sample(seq[:5], SamplingParams(max_tokens=4, temperature=0.0, stop=()),
                                   base_model=str(path)).sequences[0].tokens
            for a in ("eos_token_id", "forced_eos_token_id", "forced_bos_token_id"):  # as stop=(): never stop
                setattr(hf.generation_config, a, None)
            hf.generation_config.pad_token_id = 0
            with torch.no_grad():
                ref = hf.generate(torch.tensor([seq[:5]]), max_new_tokens=4, min_new_tokens=4,
                                  do_sample=False)[0, 5:].tolist()
            if greedy != ref:
                return row | {"support": FAILS, "detail": f"greedy sampling {greedy} differs from HF generate {ref}"}
        except (InvalidInput, NotFound) as e:
            return row | {"support": REFUSED, "detail": str(e)}
        except Exception as e:
            return row | {"support": FAILS, "detail": f"{stage}: {_first_line(e)}"}
        short = [n for n in adaptable_short_names(base.linear_shapes) if n != "lm_head"]
        kind = FAST if model_type in SUPPORTED_TYPES else TESTED if model_type in TESTED_TYPES else WORKS
        return row | {"support": kind, "detail": "LoRA targets: " + ", ".join(short) + ", lm_head"}


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _child(model_type: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    row = check_type(model_type)
    Path(out).write_text(json.dumps(row))


def run_all(types: list[str], jobs: int = JOBS, timeout: float = TIMEOUT_S) -> list[dict]:
    """check_type of every type, each in its own forked process (imports done once, here), `jobs` at a time;
    a process past `timeout` seconds is killed and its type marked skipped."""
    # Imported before forking, so that each child starts with them (most of a type's time otherwise).
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers.activations  # noqa: F401
    import transformers.generation  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import whitney.engine  # noqa: F401
    import whitney.engine.families.general  # noqa: F401
    import whitney.engine.sampling.hf_sampler  # noqa: F401

    _tokenizer()

    ctx = multiprocessing.get_context("fork")
    rows, pending, running = {}, list(types), {}
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            while pending and len(running) < jobs:
                t = pending.pop(0)
                out = os.path.join(tmp, f"{t}.json")
                p = ctx.Process(target=_child, args=(t, out), daemon=True)
                p.start()
                running[t] = (p, out, time.monotonic())
            time.sleep(0.1)
            for t, (p, out, start) in list(running.items()):
                late = time.monotonic() - start > timeout
                if p.is_alive() and not late:
                    continue
                if p.is_alive():
                    p.kill()
                p.join()
                del running[t]
                if os.path.exists(out):
                    rows[t] = json.loads(Path(out).read_text())
                else:
                    why = f"timed out after {timeout:.0f} s" if late else f"the check process died ({p.exitcode})"
                    rows[t] = {"type": t, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(t, "?"), "support": SKIPPED,
                               "detail": why}
                print(f"{t}: {rows[t]['support']}", flush=True)
    return [rows[t] for t in types]


# The doc's section on images (vision-language checkpoints), written after the table.
IMAGES = [
    "",
    "## Images",
    "",
    "Three vision-language families also take image chunks (`whitney/engine/families/vision.py`), each tested "
    "against the Hugging Face model's own forward and `generate` and against a float64 HF + PEFT "
    "reference (`tests/engine/test_vision.py`): `qwen3_5` (Qwen3_5ForConditionalGeneration), `qwen3_vl` "
    "(Qwen3VLForConditionalGeneration, loaded with `AutoModelForImageTextToText`, so not in the table "
    "above) and `gemma3` (Gemma3ForConditionalGeneration). A checkpoint takes images when its config has "
    "a vision tower and its directory holds its image processor (`preprocessor_config.json` or "
    "`processor_config.json`); without one it is served as its text model, as in the table.",
    "",
    "An image chunk occupies exactly the positions of the model's image placeholder token, as many as "
    "the model's own image processor makes of that image (the Tinker SDK's `ModelInput.length` "
    "convention: the chunk's `expected_tokens`); the markers around it are ordinary text tokens the "
    "client writes itself, as the chat templates do:",
    "",
    "- `qwen3_5`, `qwen3_vl`: `grid_t * grid_h * grid_w / merge_size^2` positions of `<|image_pad|>`, "
    "the grid being the processor's patches after its resize (a 448 x 448 image, patch 16, merge 2: 14 * "
    "14 = 196); the client writes `<|vision_start|>` before and `<|vision_end|>` after. The image "
    "advances the mrope position by `max(grid_h, grid_w) / merge_size`, not by its token count (the "
    "model's own `get_rope_index`).",
    "- `gemma3`: `mm_tokens_per_image` positions (256 in the released checkpoints) of "
    "`<image_soft_token>`, which attend to each other both ways within the image; the client writes "
    "`<start_of_image>` before and `<end_of_image>` after (the processor also puts a blank line on each "
    "side).",
    "",
    "`target_tokens`, `weights`, `advantages` and the other per-position inputs have the expanded "
    "length. `compute_logprobs` and a sample's prompt log-probs are None at the positions an image "
    "occupies (the model predicts no image). The vision tower and the projector (Qwen's merger, Gemma "
    "3's multi-modal projector) are frozen and not adaptable: LoRA adapts the language model's linears "
    "(and `lm_head`). `opsd` refuses image chunks.",
]


def render(rows: list[dict], seconds: float) -> str:
    """The whole doc from every type's row (`seconds`: how long the run took)."""
    import transformers

    counts = {k: sum(r["support"] == k for r in rows) for k in (FAST, TESTED, WORKS, REFUSED, FAILS, SKIPPED)}
    lines = [
        "# Model support",
        "",
        f"Generated by `HF_HUB_OFFLINE=1 python scripts/model_support.py` ({seconds / 60:.0f} minutes here); do not "
        "edit by hand. `tests/test_model_support.py` checks it against the code.",
        "",
        f"Every causal-LM model type of transformers {transformers.__version__} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), "
        "built offline as a tiny random model (2 layers, hidden 64, 4 heads of 16, MLP 128, 4 experts of 32, the "
        "SmolLM2 tokenizer's vocabulary; one layer of each kind) and served through Whitney's loader: load and "
        "self-checks, base log-probs against the model's own forward (1e-4), a LoRA run's forward_backward and "
        "optim_step (finite, non-zero gradients), and greedy sampling against HF `generate`. A tiny config checks "
        "the code path, not a real checkpoint's numbers.",
        "",
        "- **fast path**: the hand-written decoder (`whitney.engine.families.model.SUPPORTED_TYPES`).",
        "- **general path (tested family)**: the model's own modules with per-row LoRA hooks "
        "(`whitney.engine.families.general.TESTED_TYPES`), each family tested against HF and PEFT.",
        "- **general path (works, untested)**: the same path; every check above passes, but no dedicated test.",
        "- **refused**: Whitney's answer at `whitney serve` or run creation (the general path's checks).",
        "- **fails**: loaded, then a check failed (not served correctly: the stage and error).",
        "- **skipped**: no tiny model could be built offline from the config defaults (the reason).",
        "",
        "Summary: " + ", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({len(rows)} model types).",
        "",
        "| model type | class | support | detail |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        detail = r["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{r['type']}` | {r['class']} | {r['support']} | {detail} |")
    return "\n".join(lines + IMAGES) + "\n"


def read_table(path: Path = DOC) -> dict[str, dict]:
    """The rows of a generated doc, by model type: {type, class, support, detail}."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0].strip("`")] = {"type": cells[0].strip("`"), "class": cells[1], "support": cells[2],
                                         "detail": cells[3].replace("\\|", "|")}
    return rows


def main(argv: list[str]) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    update = argv[:1] == ["--update"]
    types = argv[1:] if update else argv or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    start = time.monotonic()
    rows = run_all(types)
    if argv and not update:
        print(json.dumps(rows, indent=2))
        return 0
    if update:  # these rows replaced, the others (and the full run's time) kept
        table = read_table() | {r["type"]: r for r in rows}
        minutes = re.search(r"\((\d+) minutes here\)", DOC.read_text())
        rows = [table[t] for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        start = time.monotonic() - 60 * int(minutes.group(1)) if minutes else start
    DOC.write_text(render(rows, time.monotonic() - start))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
