"""Write docs/TINKER_COMPATIBILITY.md: every public method of the tinker SDK's clients, the tests that call it,
and whether they pass.

    python scripts/tinker_compat_doc.py                 # runs tests/tinker (HF_HUB_OFFLINE=1), then writes the doc
    python scripts/tinker_compat_doc.py --junit r.xml   # uses an existing pytest --junitxml report instead
    python scripts/tinker_compat_doc.py --check         # exit 1 if the committed doc differs from a fresh one

A method counts as covered by a test when the test function calls an attribute of that name
(`tc.forward_backward(...)`, `rest.list_checkpoints(...)`) on an SDK object (receivers named in
NATIVE_RECEIVERS are Whitney's own client and store), found by walking tests/tinker/*.py with ast.
Calls made inside a module fixture count for every test that uses the fixture. A method passes when
every test covering it passed.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import subprocess
import sys
import tempfile
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "tinker"
DOC = ROOT / "docs" / "TINKER_COMPATIBILITY.md"

# Methods whose endpoints Whitney does not serve, and why. Anything else uncovered is simply untested.
NOT_SERVED = {
    "get_billing_usage": "billing (a self-hosted server bills nobody)",
    "get_current_checkpoint_storage_usage": "billing (a self-hosted server bills nobody)",
}
# Receivers in the tests that are Whitney's native side (whitney.Client, its runs, the store), not the SDK.
NATIVE_RECEIVERS = ("store", "run", "native", "http", "trained['run']", "trained['client']", "np", "torch",
                    "tinker_env")
LOCAL_ONLY = {"get_console_url", "get_telemetry", "get_tokenizer", "get_base_model",
              "on_queue_state_change", "create", "create_rest_client"}


def sdk_methods() -> dict[str, list[tuple[str, bool]]]:
    """Client name -> [(method, deprecated)] for the SDK's four clients."""
    import tinker

    out = {}
    for cls in (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient):
        methods = []
        for name, fn in inspect.getmembers(cls):
            if name.startswith("_") or not callable(fn):
                continue
            doc = (inspect.getdoc(fn) or "").lstrip()
            deprecated = hasattr(fn, "__deprecated__") or doc.lower().startswith("deprecated")
            methods.append((name, deprecated))
        out[cls.__name__] = methods
    return out


def calls_by_test() -> dict[str, set[str]]:
    """'file.py::test_name' -> attribute names the test calls (its fixtures' calls included)."""
    out: dict[str, set[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

        def called(fn: ast.FunctionDef, seen: set[str]) -> set[str]:
            names = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and not ast.unparse(n.func.value).startswith(NATIVE_RECEIVERS)}
            for arg in fn.args.args:  # fixtures and helpers defined in the same file
                if arg.arg in functions and arg.arg not in seen:
                    names |= called(functions[arg.arg], seen | {arg.arg})
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in functions \
                        and n.func.id not in seen:
                    names |= called(functions[n.func.id], seen | {n.func.id})
            return names

        for name, fn in functions.items():
            if name.startswith("test_"):
                out[f"{path.name}::{name}"] = called(fn, {name})
    return out


def run_tests(junit: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", str(TESTS), f"--junitxml={junit}"],
                   cwd=ROOT, env=env, check=False)


def skipped(junit: Path) -> set[str]:
    return {f"{c.get('classname', '').rsplit('.', 1)[-1]}.py::{c.get('name', '')}"
            for c in ET.parse(junit).getroot().iter("testcase") if any(ch.tag == "skipped" for ch in c)}


def outcomes(junit: Path) -> dict[str, bool]:
    """'file.py::test_name' -> passed (a parametrized test passes when every case passed)."""
    result: dict[str, bool] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if not case.get("classname", "").startswith("tests.tinker."):
            continue
        file = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        name = case.get("name", "").split("[", 1)[0]
        ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
        key = f"{file}::{name}"
        result[key] = result.get(key, True) and ok
    return result


TITLE = "# Tinker SDK compatibility"
GENERATED = "## Methods and their tests"  # everything from this heading on is written here; the quickstart above
#                                          it is written by hand in the doc and kept as it is


def quickstart() -> str:
    """The hand-written part of the doc: between the title and GENERATED (tests/tinker/test_quickstart_doc.py
    runs its code)."""
    text = DOC.read_text() if DOC.exists() else ""
    head, found, _ = text.partition("\n" + GENERATED + "\n")
    if not found or not head.startswith(TITLE):
        raise SystemExit(f"{DOC.relative_to(ROOT)} lost its hand-written quickstart (between {TITLE!r} and "
                         f"{GENERATED!r}): restore it from git before regenerating")
    return head[len(TITLE):].strip("\n")


def render(methods, calls, passed, skips) -> str:
    import tinker

    lines = [
        TITLE,
        "",
        quickstart(),
        "",
        GENERATED,
        "",
        f"Generated by `scripts/tinker_compat_doc.py` against tinker {tinker.__version__}: every public method "
        "of the SDK's four clients, the tests in `tests/tinker/` that call it (against a real Whitney server, "
        "comparing with the native API where there is a number to compare), and whether they pass.",
        "Point the unmodified SDK at Whitney with `TINKER_BASE_URL=http://host:port` and "
        "`TINKER_API_KEY=tml-<anything>` (a key the server knows, when it has keys).",
        "",
        "Status: **pass** (covered, all covering tests pass), **FAIL**, **untested** (served, no test calls it), "
        "**local** (no server call, or only setup calls), **not served** (the endpoint does not exist here).",
        "",
    ]
    totals = {"pass": 0, "FAIL": 0, "untested": 0, "local": 0, "not served": 0}
    for client, entries in methods.items():
        lines += [f"## {client}", "", "| method | status | tests |", "|---|---|---|"]
        for name, deprecated in entries:
            base = name.removesuffix("_async")
            tests = sorted(t for t, names in calls.items() if name in names)
            if tests:
                status = "pass" if all(passed.get(t, False) for t in tests) else "FAIL"
            elif base in NOT_SERVED:
                status = "not served"
            elif name in LOCAL_ONLY:
                status = "local"
            else:
                status = "untested"
            totals[status] += 1
            label = f"`{name}`" + (" (deprecated)" if deprecated else "")
            note = NOT_SERVED.get(base, "") if status == "not served" else ""
            shown = ", ".join(f"`{t.split('::')[1]}`" for t in tests[:4]) + (" ..." if len(tests) > 4 else "")
            lines.append(f"| {label} | {status} | {shown or note} |")
        lines.append("")
    lines += ["## Totals", "", " · ".join(f"{k}: {v}" for k, v in totals.items()), ""]
    lines += ["## tinker-cookbook 0.6.1 recipes", "",
              "Run unmodified, offline, on the tiny model by `tests/tinker/test_cookbook*.py` (`make test` installs "
              "the cookbook; test_cookbook.py's docstring says how, since `tml-renderers` is not on PyPI).", ""]
    for test in sorted(t for t in calls if t.startswith("test_cookbook")):
        status = "skipped" if test in skips else "pass" if passed.get(test) else "FAIL"
        lines.append(f"- `{test.split('::')[0]}::{test.split('::')[1]}`: {status}")
    lines += ["", NOTES]
    return "\n".join(lines)


NOTES = """## Behaviour worth knowing

- A Tinker model id `{session_id}:train:{n}` is the native run id, and a Tinker request id is the native
  operation id: the native API (`/v1/runs/{id}`, `/v1/operations/{id}`) sees the same runs and operations.
- `forward_backward` bodies are protobuf; forward/forward_backward and sample results go back as protobuf.
  2-D (soft) `target_tokens`/`weights` may be sparse CSR; absent cells are 0. The body is decoded off the
  event loop, its tokens and the values its sparse tensors expand to (at most `max_request_bytes` / 4, what
  a dense body could hold) counted before any tensor is made: beyond a limit, a 413.
- Losses: `cross_entropy`, `importance_sampling`, `ppo` and `cispo` (absolute `clip_low_threshold` /
  `clip_high_threshold`, default 0.8 / 1.2), `dro` (`beta`), `gspo` (GSPO-token: needs
  `sequence_ratio_mask`; clipped like ppo), and server-side custom losses (`create_custom_loss`, then
  `forward_backward_custom` with the handle; the graph is rebuilt from an allow-list of operations, never
  executed as Python). `stable_reinforce` is not served: its objective, and the stability information its
  sampler records (`record_stability_info`), are not published; it fails its future as a user error saying
  so, as does a per-datum input no loss takes.
- Loss metrics (every loss above, `opsd` too) are all named `<name>:sum` or `<name>:mean`, so the SDK combines
  the requests it splits a `forward`/`forward_backward` into (more than 1024 datums, or about 5 MB, each):
  sums stay exact; a mean is the requests' means weighted by their datums, so a mean over tokens
  (`ratio:mean`, `clipped_fraction:mean`, `opsd_kl:mean`, `ce_loss:mean`) is exact only within one request.
- `optim_step` honours `learning_rate`, `beta1`, `beta2`, `eps`, `weight_decay`, `grad_clip_norm`; Adam only.
  The Dimuon optimizer is not served: its definition is not published. Choosing it at model creation
  (`optimizer_config`) is a 400 naming the field; an `optim_step` with `DimuonParams` fails its future as a user
  error saying only Adam is served.
- Sampling honours `max_tokens`, `temperature`, `top_k`, `top_p`, `seed`, `stop` (strings or token ids;
  `[]` disables EOS), `num_samples`, prompt log-probs, `topk_prompt_logprobs` and `topk_sample_logprobs`
  (at most 100; the SDK's empty slots, token 0 with log-prob -99999, where a position has none),
  `prompt_logprobs_last_n`, and `target_prompt_logprobs` (dense or sparse CSR; the answer has the request's
  layout). `prompt_alt_tokens_k` and `record_stability_info` are refused with a 400 rather than ignored.
  Samplers are snapshots (an `inflight` save is a snapshot).
- Model input chunks: `EncodedTextChunk`; `ImageChunk` (PNG or JPEG bytes; `expected_tokens`, when given, must be
  what the model's processor makes of the image) in `forward`/`forward_backward` (protobuf), `sample` and
  `compute_logprobs`, on vision-language models only (`get_server_capabilities` marks them `vision`); and
  `ImageAssetPointerChunk` in `sample` and `compute_logprobs` (the SDK's protobuf writer has no pointer chunk,
  so it cannot send one to `forward_backward`), for a file under a directory the operator allowed (`whitney
  serve --image-dir`). URLs are refused: the server fetches nothing from the network. `DmelChunk` (audio) and
  `ImageChunk.override_dimensions` are refused with a 400; so are images over the server's limits (413) or that
  do not decode.
- `save_state` honours `overwrite` (without it an existing name is refused). Checkpoint `ttl_seconds` (1 s to
  10 years here; Tinker's lower bound of an hour is not enforced) and `user_metadata` are kept: an expired
  checkpoint reads 404 and the server deletes it (files and row) within seconds, never while a load, sample,
  download or copy of it is in progress. Sampling sessions live in the server process.
- Published checkpoints are readable (load, sample, copy, download URLs) by every key, writable only by their
  owner. `copy_weights` (and `weights_access_token` on loads) reads another key's checkpoint when that key is
  presented as the weights access token (the caller holds both keys); copies are hard links in a finished run
  that is not trained. `save_weights_external` writes a Hugging Face PEFT adapter
  (`tinker://.../external_weights/NAME`); `get_external_weights_urls` gives signed URLs served by this server;
  `age_encryption_recipients` is refused.
- Sessions keep `tags` (`TINKER_TAGS`), `project_id` and `display_name`; `search_sessions` filters on them
  (a key sees only its own sessions, so `accessible` is the caller's own; finish reasons are not recorded).
  `whoami`: the SDK exchanges its key for a JWT of this server (`pjwt_auth_enabled`), whose subject is
  `tml:user:whitney-key:<key id>`. `export_session_trace` gives a signed URL of the session's operations as a
  Chrome trace-event JSON document (Perfetto opens it; not Tinker's `.pftrace` protobuf); `get_audit_log`
  lists the key's operations of the day as `operation_<kind>` events (no projects, teams or organizations).
- A clash with the state is a 400, never a 409: the SDK retries 409 and 5xx for minutes.
- Recipes: `math_rl` defaults to `loss_fn=stable_reinforce`, which is not served (see Losses); pass
  `loss_fn=importance_sampling` (or ppo, cispo, dro, gspo). A local model directory works as `model_name`.
  `sdft` (self-distillation on the teacher's `topk_prompt_logprobs`) runs in its default forward-KL mode;
  its `reverse=True` mode needs the forward output `logprobs` of [N, K] `target_tokens` as [N, K], and
  Whitney returns one weight-normalised log-prob per position ([N]).
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="an existing pytest --junitxml report of tests/tinker")
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc on disk is not up to date")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    junit = args.junit
    if junit is None:
        junit = Path(tempfile.mkdtemp()) / "tinker.xml"
        run_tests(junit)
    text = render(sdk_methods(), calls_by_test(), outcomes(junit), skipped(junit))
    if args.check:
        return 0 if DOC.exists() and DOC.read_text() == text else 1
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
