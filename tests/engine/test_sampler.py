"""Sampling: KV-cached decode, greedy and stochastic choice, stops, seeds, mixed batches, continuous
batching, memory bounds, log-prob consistency with training, version pinning and validation."""

from __future__ import annotations

import pytest
import torch

from tests.models import VOCAB
from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.families.lora import RowGroups, init_adapter
from whitney.engine.families.decoder import full_logprobs
from whitney.engine.families.transformer import KVCache
from whitney.errors import InvalidInput, NotFound
from whitney.protocol.sampling import SamplingParams, validate

EOS = 2
LR = {"learning_rate": 1e-2}
P1 = [1, 873, 2201, 5120, 40, 777]  # prompts of different lengths
P2 = [1, 15, 9000, 31, 4242, 17, 600, 12000, 8]
P3 = [1, 3030]


# ---- helpers -------------------------------------------------------------------------------


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=kw.pop("stop", ()), **kw)


def train(engine: Engine, run_id: str, g: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        s = torch.randint(0, VOCAB, (9,), generator=g).tolist()
        engine.forward_backward(run_id, [Datum(s[:-1], {"target_tokens": s[1:]})])
        engine.optim_step(run_id, LR)


def drain(engine: Engine) -> None:
    for _ in range(10_000):
        if not engine.sample_step():
            return
    raise AssertionError("sampler never became idle")


def ref_logits(base, adapter, seq: list[int]) -> torch.Tensor:
    """Logits [len(seq), V] of the full (uncached) forward, the reference for every decode step."""
    with torch.no_grad():
        h = base.forward_hidden(torch.tensor([seq]), RowGroups([(0, 1, adapter)]))[0]  # [T, D]
        return base.unembed(h, RowGroups([(0, len(seq), adapter)]))


def gen_logits(base, adapter, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] from which each generated token was chosen."""
    return ref_logits(base, adapter, prompt + tokens)[len(prompt) - 1: len(prompt) + len(tokens) - 1]


def sampler_of(engine: Engine):
    (s,) = engine.samplers.values()
    return s


@pytest.fixture(scope="module")
def world(tiny_llama):
    """One engine on the tiny Llama with runs a and b trained 3 steps each and saved as version 1."""
    e = Engine()
    g = torch.Generator().manual_seed(0)
    for rid, seed in (("a", 1), ("b", 2)):
        e.create_run(rid, tiny_llama, LoraConfig(rank=4, seed=seed))
        train(e, rid, g, 3)
        assert e.save_weights_for_sampler(rid) == 1
    return e


@pytest.fixture
def eng(world):
    drain(world)
    assert all(s.idle for s in world.samplers.values())
    yield world
    drain(world)


def base_of(e: Engine, path: str):
    return e.models[path]


# ---- the KV cache ----------------------------------------------------------------------------


def test_kv_cached_decode_equals_full_forward(tiny_model):
    """decode_hidden after a ragged prefill (rows of different prompt lengths, mixed adapters, a small
    cache that must grow, a row leaving midway) equals forward_hidden over each whole sequence."""
    e = Engine()
    base = e.load_model(tiny_model)
    adapter = init_adapter(base, LoraConfig(rank=4, seed=3))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for b in adapter.B.values():
            b.normal_(0.0, 0.05, generator=g)
    lengths = [3, 7, 1, 5]
    adapters = [adapter, None, adapter, None]
    seqs = [torch.randint(0, VOCAB, (n + 12,), generator=g).tolist() for n in lengths]
    T = max(lengths)
    tokens = torch.zeros(len(seqs), T, dtype=torch.int64)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        tokens[i, :n] = torch.tensor(s[:n])
    kv: list = []
    groups = RowGroups([(i, i + 1, a) for i, a in enumerate(adapters)])
    with torch.no_grad():
        base.forward_hidden(tokens, groups, kv_out=kv)
    assert len(kv) == base.config.num_layers
    cache = KVCache.empty(base, capacity=4)  # smaller than the prompts: append and decode must grow it
    cache.append(kv, torch.tensor(lengths))
    refs = []
    for s, a in zip(seqs, adapters):
        with torch.no_grad():
            refs.append(base.forward_hidden(torch.tensor([s]), RowGroups([(0, 1, a)]))[0])  # [n+12, D]
    alive = list(range(len(seqs)))
    steps = [0] * len(seqs)
    for step in range(12):
        if step == 5:  # row 1 finishes: it leaves the cache, the others must be unaffected
            cache.keep(torch.tensor([j for j, r in enumerate(alive) if r != 1]))
            alive.remove(1)
        nxt = torch.tensor([seqs[r][lengths[r] + steps[r]] for r in alive])
        dgroups = RowGroups([(torch.tensor([j for j, r in enumerate(alive) if adapters[r] is adapter]), adapter)])
        with torch.no_grad():
            h = base.decode_hidden(nxt, dgroups, cache)  # [B, D]
        assert h.shape == (len(alive), base.config.hidden_size)
        for j, r in enumerate(alive):
            pos = lengths[r] + steps[r]
            torch.testing.assert_close(
                h[j], refs[r][pos], atol=1e-4, rtol=0,
                msg=lambda m: f"KV-cache bug: decode step {step} of row {r} (prompt length {lengths[r]}) "
                              f"differs from the full forward at position {pos}: {m}")
            steps[r] += 1
        assert cache.lengths.tolist() == [lengths[r] + steps[r] for r in alive], "cache lengths not advanced"
    assert cache.k[0].shape[2] >= max(lengths) + 12, "cache capacity never grew"


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_equals_top_k_1(eng, tiny_llama):
    for w in ({"base_model": tiny_llama}, {"run_id": "a", "version": 1}):
        g = eng.sample(P1, greedy(10), **w).sequences[0]
        k1 = eng.sample(P1, SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=5, stop=()), **w)
        assert k1.sequences[0].tokens == g.tokens, f"top_k=1 at temperature 1 is not greedy ({w})"
        assert k1.sequences[0].logprobs == pytest.approx(g.logprobs, abs=1e-6)


def test_greedy_equals_hf_argmax_step_by_step(tiny_model):
    """The base model's greedy tokens are the argmax of Hugging Face's logits on the growing sequence."""
    from transformers import AutoModelForCausalLM

    e = Engine()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for prompt in (P1, P3):
        out = e.sample(prompt, greedy(10), base_model=tiny_model).sequences[0]
        assert len(out.tokens) == 10 and out.stop_reason == "length"
        seq = list(prompt)
        for i, tok in enumerate(out.tokens):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
            lp = torch.log_softmax(logits, -1)
            assert tok == int(torch.argmax(logits)), f"greedy/decode bug: token {i} is not the full-forward argmax"
            assert out.logprobs[i] == pytest.approx(float(lp[tok]), abs=1e-4), f"logprob of greedy token {i} wrong"
            seq.append(int(torch.argmax(logits)))


def test_greedy_run_version_equals_forward_argmax(eng, tiny_llama):
    """A trained run's greedy tokens are the argmax of its own full forward (adapter used in decode)."""
    base = base_of(eng, tiny_llama)
    adapter, _ = eng.resolve_weights(run_id="a", version=1)
    out = eng.sample(P2, greedy(12), run_id="a", version=1).sequences[0]
    logits = gen_logits(base, adapter, P2, out.tokens)
    assert out.tokens == logits.argmax(-1).tolist(), "adapter missing or wrong in the decode steps"
    torch.testing.assert_close(torch.tensor(out.logprobs), full_logprobs(logits).max(-1).values, atol=1e-4, rtol=0)
    # The adapter matters: the base gives other log-probs for the same sequence.
    base_logits = gen_logits(base, None, P2, out.tokens)
    assert (full_logprobs(base_logits).max(-1).values - torch.tensor(out.logprobs)).abs().max() > 1e-3


# ---- stops -----------------------------------------------------------------------------------


def _boundary_stop(tok, tokens: list[int]) -> tuple[int, str] | None:
    """(i, s): s is the last character of token i's text + the first of token i+1's, where token i+1's
    text is longer than one character (so s ends inside it) and s never appeared before."""
    for i in range(1, len(tokens) - 1):
        prefix, full = tok.decode(tokens[: i + 1]), tok.decode(tokens[: i + 2])
        if not prefix or not full.startswith(prefix) or len(full) - len(prefix) < 2:
            continue
        s = prefix[-1] + full[len(prefix)]
        if s not in prefix and s.strip() == s and "\ufffd" not in full:
            return i, s
    return None


def test_stop_string_spanning_a_token_boundary(eng, tiny_llama):
    eng.load_model(tiny_llama)
    tok = base_of(eng, tiny_llama).tokenizer
    found = None
    for prompt in (P1, P2, P3, [1, 50, 60, 70]):
        free = eng.sample(prompt, greedy(16), base_model=tiny_llama).sequences[0]
        found = _boundary_stop(tok, free.tokens)
        if found:
            break
    assert found, "no token boundary to test on"
    i, s = found
    out = eng.sample(prompt, greedy(16, stop=[s]), base_model=tiny_llama).sequences[0]
    assert out.tokens == free.tokens[: i + 2], (
        f"stop string {s!r} spans tokens {i} and {i + 1}: must stop right after token {i + 1}, "
        f"got {len(out.tokens)} tokens")
    assert out.stop_reason == "stop"
    assert out.logprobs == free.logprobs[: i + 2]
    # A string that never appears does not stop; the earliest of several stops wins.
    out = eng.sample(prompt, greedy(16, stop=["\x00never\x00"]), base_model=tiny_llama).sequences[0]
    assert out.tokens == free.tokens and out.stop_reason == "length", "a stop string that never appears stopped"
    # Only generated text counts: a string found in the prompt's text (and never generated) does not stop.
    ptext, gtext = tok.decode(prompt), tok.decode(free.tokens)
    in_prompt = next((ptext[k:k + 3] for k in range(len(ptext) - 2) if ptext[k:k + 3] not in gtext), None)
    assert in_prompt
    out = eng.sample(prompt, greedy(16, stop=[in_prompt]), base_model=tiny_llama).sequences[0]
    assert out.tokens == free.tokens, "a stop string in the prompt's text stopped generation"
    later = tok.decode(free.tokens)[-3:]
    out = eng.sample(prompt, greedy(16, stop=[later, s]), base_model=tiny_llama).sequences[0]
    assert out.tokens == free.tokens[: i + 2], "the first stop string to appear must stop, whatever its order"


def _first_new_at(tokens: list[int], start: int) -> int:
    for j in range(start, len(tokens)):
        if tokens[j] not in tokens[:j]:
            return j
    raise AssertionError("greedy output has no fresh token")


def test_token_id_and_sequence_stops(eng, tiny_llama):
    w = {"run_id": "a", "version": 1}
    free = eng.sample(P2, greedy(12), **w).sequences[0].tokens
    j = _first_new_at(free, 2)  # normally 2: the 3rd token
    out = eng.sample(P2, greedy(12, stop=[free[j]]), **w).sequences[0]
    assert out.tokens == free[: j + 1] and out.stop_reason == "stop", "token-id stop did not stop at that token"
    # A sequence stop matches consecutive tokens only.
    out = eng.sample(P2, greedy(12, stop=[[free[j - 1], free[j]]]), **w).sequences[0]
    assert out.tokens == free[: j + 1] and out.stop_reason == "stop", "token-sequence stop missed"
    out = eng.sample(P2, greedy(12, stop=[(free[j - 1], free[j])]), **w).sequences[0]
    assert out.tokens == free[: j + 1], "a tuple token-sequence stop behaves unlike a list"
    absent = next(t for t in range(3, VOCAB) if t not in free)
    out = eng.sample(P2, greedy(12, stop=[[absent, free[j]], [free[j], absent]]), **w).sequences[0]
    assert out.tokens == free and out.stop_reason == "length", "a partial sequence match stopped"
    # A stop in the prompt does not count: only generated tokens stop.
    out = eng.sample(P2, greedy(12, stop=[P2[-1]] if P2[-1] not in free else [absent]), **w).sequences[0]
    assert out.tokens == free, "a stop token in the prompt stopped generation"


@pytest.fixture(scope="module")
def eos_run(world, tiny_llama):
    """A run trained to emit EOS as its 3rd token after P1: returns (version, its greedy tokens)."""
    e = world
    free = e.sample(P1, greedy(2), base_model=tiny_llama).sequences[0].tokens
    e.create_run("eos", tiny_llama, LoraConfig(rank=4, seed=5))
    seq = P1 + free[:2] + [EOS]
    for _ in range(40):
        e.forward_backward("eos", [Datum(seq[:-1], {"target_tokens": seq[1:]})])
        e.optim_step("eos", LR)
        v = e.save_weights_for_sampler("eos")
        out = e.sample(P1, greedy(3), run_id="eos", version=v).sequences[0].tokens
        if out[2] == EOS and EOS not in out[:2]:
            return v, out
    raise AssertionError("could not train a run to emit EOS")


def test_default_stop_is_eos_and_empty_stop_disables_it(eng, eos_run):
    v, expected = eos_run
    out = eng.sample(P1, SamplingParams(max_tokens=10, temperature=0.0), run_id="eos", version=v).sequences[0]
    assert out.tokens == expected and out.tokens[-1] == EOS, "stop=None must stop at EOS (and include it)"
    assert out.stop_reason == "stop"
    out = eng.sample(P1, SamplingParams(max_tokens=10, temperature=0.0, stop=()), run_id="eos", version=v).sequences[0]
    assert len(out.tokens) == 10 and out.stop_reason == "length", "stop=() must not stop at EOS"
    assert out.tokens[:3] == expected, "EOS was sampled and then ignored"
    # An explicit stop list replaces EOS too.
    out = eng.sample(P1, SamplingParams(max_tokens=10, temperature=0.0, stop=["\x00"]),
                     run_id="eos", version=v).sequences[0]
    assert len(out.tokens) == 10 and out.stop_reason == "length", "an explicit stop list must not add EOS"


def test_max_tokens_is_respected(eng, tiny_llama):
    for n in (1, 2, 7):
        r = eng.sample(P3, SamplingParams(max_tokens=n, temperature=1.0, seed=4, stop=(), num_samples=3),
                       base_model=tiny_llama)
        assert len(r.sequences) == 3
        for s in r.sequences:
            assert len(s.tokens) == n and len(s.logprobs) == n, f"max_tokens={n} not respected"
            assert s.stop_reason == "length"


# ---- samples and seeds ----------------------------------------------------------------------


def test_num_samples_vary_at_temperature_1_and_agree_when_greedy(eng):
    r = eng.sample(P1, SamplingParams(max_tokens=6, temperature=1.0, seed=0, stop=(), num_samples=8),
                   run_id="a", version=1)
    seqs = [tuple(s.tokens) for s in r.sequences]
    assert len(seqs) == 8 and all(len(s) == 6 for s in seqs)
    assert len(set(seqs)) > 1, "all 8 samples identical at temperature 1: samples share one random stream"
    r = eng.sample(P1, greedy(6, num_samples=4), run_id="a", version=1)
    solo = eng.sample(P1, greedy(6), run_id="a", version=1).sequences[0]
    assert all(s.tokens == solo.tokens for s in r.sequences), "greedy samples differ"


def test_samples_keep_their_index_order_when_they_finish_apart(eng):
    """Sample s of a seeded request is the same stream whatever stops apply; stopped samples finish at
    different steps and must still land at their own index."""
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=77, stop=(), num_samples=4)
    free = [s.tokens for s in eng.sample(P1, p, run_id="a", version=1).sequences]
    # Stop at a token that sample 1 produces early (and some others later or never).
    stop = free[1][1]
    want = [f[: f.index(stop) + 1] if stop in f else f for f in free]
    assert len({len(w) for w in want}) > 1, "samples would all finish together: test needs another token"
    got = eng.sample(P1, SamplingParams(max_tokens=10, temperature=1.0, seed=77, stop=[stop], num_samples=4),
                     run_id="a", version=1).sequences
    assert [s.tokens for s in got] == want, "samples stored in finishing order instead of their index"
    assert [s.stop_reason for s in got] == ["stop" if stop in f else "length" for f in free]


def test_temperature_shapes_the_distribution(eng):
    g = eng.sample(P2, greedy(8), run_id="a", version=1).sequences[0]
    for seed in (0, 1, 2):
        r = eng.sample(P2, SamplingParams(max_tokens=8, temperature=1e-3, seed=seed, stop=()),
                       run_id="a", version=1).sequences[0]
        assert r.tokens == g.tokens, "temperature 1e-3 must be (numerically) greedy: temperature ignored?"
    mean = {}
    for t in (0.3, 3.0):
        r = eng.sample(P2, SamplingParams(max_tokens=8, temperature=t, seed=5, stop=(), num_samples=8),
                       run_id="a", version=1)
        lps = [x for s in r.sequences for x in s.logprobs]
        mean[t] = sum(lps) / len(lps)
    assert mean[0.3] > mean[3.0] + 0.5, f"higher temperature did not pick less likely tokens: {mean}"


def test_tiny_positive_temperature_is_greedy_and_keeps_the_sampler_usable(eng):
    """Valid temperatures down to the smallest float: logits / t used to overflow to inf, softmax gave NaN,
    multinomial raised mid-step and left the KV cache out of step with the rows, breaking every later request."""
    g = eng.sample(P2, greedy(6), run_id="a", version=1).sequences[0]
    for t in (1e-40, 1e-45, 5e-324):
        r = eng.sample(P2, SamplingParams(max_tokens=6, temperature=t, seed=1, stop=(), top_k=7, top_p=0.9),
                       run_id="a", version=1).sequences[0]
        assert r.tokens == g.tokens, f"temperature {t} is not greedy"
        s = sampler_of(eng)
        assert s.cache.rows == len(s.rows) == 0
    assert eng.sample(P2, greedy(6), run_id="a", version=1).sequences[0].tokens == g.tokens


def test_seed_determinism(eng, tiny_llama):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, stop=(), num_samples=2)
    r1 = eng.sample(P2, p, run_id="a", version=1)
    r2 = eng.sample(P2, p, run_id="a", version=1)
    assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences], "same seed, different tokens"
    other = eng.sample(P2, SamplingParams(max_tokens=10, temperature=1.0, seed=99, stop=(), num_samples=2),
                       run_id="a", version=1)
    assert [s.tokens for s in other.sequences] != [s.tokens for s in r1.sequences], "the seed is ignored"
    # Inside a mixed batch (other adapters, params, prompt lengths, also after it started) the same.
    s = sampler_of(eng)
    others = [eng.submit_sample(P1, greedy(12), base_model=tiny_llama),
              eng.submit_sample(P3, SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=7, stop=()),
                                run_id="b", version=1),
              eng.submit_sample(P1, SamplingParams(max_tokens=14, temperature=1.5, top_k=10, num_samples=3, stop=()),
                                run_id="a", version=1)]
    eng.sample_step()
    req = eng.submit_sample(P2, p, run_id="a", version=1)
    eng.sample_step()
    late = eng.submit_sample(P3, SamplingParams(max_tokens=3, temperature=1.0, stop=()), run_id="b", version=1)
    while not all(r.done for r in [*others, req, late]):
        assert len(s.rows) <= eng.max_sequences
        eng.sample_step()
    for a, b in zip(req.result.sequences, r1.sequences):
        assert a.tokens == b.tokens, "a seeded request sampled differently inside a mixed batch"
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_mixed_adapter_batch_equals_solo(eng, tiny_llama):
    cases = [(P1, {"base_model": tiny_llama}), (P2, {"run_id": "a", "version": 1}),
             (P3, {"run_id": "b", "version": 1}), (P2, {"base_model": tiny_llama}),
             (P1, {"run_id": "b", "version": 1})]
    solo = [eng.sample(p, greedy(10), **w).sequences[0] for p, w in cases]
    reqs = [eng.submit_sample(p, greedy(10), **w) for p, w in cases]
    assert len(sampler_of(eng).queue) == len(cases)
    eng.sample_step()
    assert len(sampler_of(eng).rows) == len(cases), "requests were not batched together"
    while not all(r.done for r in reqs):
        eng.sample_step()
    for (p, w), r, s in zip(cases, reqs, solo):
        assert r.result.sequences[0].tokens == s.tokens, f"mixed batch changed the tokens of {w}: adapter mix-up"
        assert r.result.sequences[0].logprobs == pytest.approx(s.logprobs, abs=1e-5)
    # Not vacuous: the same prompt under base, a and b gives different log-probs.
    lp = {k: eng.sample(P2, greedy(4), **w).sequences[0].logprobs
          for k, w in (("base", {"base_model": tiny_llama}), ("a", {"run_id": "a", "version": 1}),
                       ("b", {"run_id": "b", "version": 1}))}
    assert lp["base"] != pytest.approx(lp["a"], abs=1e-4) and lp["a"] != pytest.approx(lp["b"], abs=1e-4)


def test_version_pinning(eng, tiny_llama):
    eng.create_run("pin", tiny_llama, LoraConfig(rank=4, seed=7))
    g = torch.Generator().manual_seed(3)
    train(eng, "pin", g, 2)
    v1 = eng.save_weights_for_sampler("pin")
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=21, stop=())
    before = eng.sample(P1, p, run_id="pin", version=v1).sequences[0]
    before_g = eng.sample(P1, greedy(10), run_id="pin", version=v1).sequences[0]
    train(eng, "pin", g, 3)
    v2 = eng.save_weights_for_sampler("pin")
    assert (v1, v2) == (1, 2)
    after = eng.sample(P1, p, run_id="pin", version=v1).sequences[0]
    after_g = eng.sample(P1, greedy(10), run_id="pin", version=v1).sequences[0]
    assert after.tokens == before.tokens and after.logprobs == before.logprobs, "v1 saw later training"
    assert after_g.tokens == before_g.tokens and after_g.logprobs == before_g.logprobs, "v1 saw later training"
    new = eng.sample(P1, greedy(10), run_id="pin", version=v2).sequences[0]
    assert new.logprobs != pytest.approx(before_g.logprobs, abs=1e-4), "v2 does not include the new training"
    # A request queued on v2 still uses v2 after more training (weights are resolved at submit).
    req = eng.submit_sample(P1, greedy(10), run_id="pin", version=v2)
    train(eng, "pin", g, 1)
    drain(eng)
    assert req.result.sequences[0].logprobs == new.logprobs


# ---- log-probs ------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=1.0, seed=8, stop=(), prompt_logprobs=True, topk_prompt_logprobs=5),
    SamplingParams(max_tokens=10, temperature=0.5, top_k=20, top_p=0.9, seed=9, stop=(), num_samples=2),
], ids=["t1", "t0.5-topk-topp"])
def test_logprobs_match_compute_logprobs_and_forward(eng, tiny_llama, params):
    """Sampled log-probs are the temperature-1 log-probs that compute_logprobs and forward give."""
    r = eng.sample(P2, params, run_id="a", version=1)
    for s in r.sequences:
        full = P2 + s.tokens
        (cl,) = eng.compute_logprobs([full], run_id="a", version=1)
        assert s.logprobs == pytest.approx(cl[len(P2):], abs=1e-4), (
            "sampled log-probs differ from compute_logprobs (temperature/top-k applied, or wrong weights)")
        fw = eng.forward("a", [Datum(full[:-1], {"target_tokens": full[1:]})]).outputs[0].logprobs
        assert s.logprobs == pytest.approx(fw[len(P2) - 1:], abs=1e-4), "sampled log-probs differ from forward"
    if not params.prompt_logprobs:
        assert r.prompt_logprobs is None and r.topk_prompt_logprobs is None
        return
    (cl,) = eng.compute_logprobs([P2], run_id="a", version=1)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(P2)
    assert r.prompt_logprobs[1:] == pytest.approx(cl[1:], abs=1e-4), "prompt_logprobs differ from compute_logprobs"
    top = r.topk_prompt_logprobs
    assert len(top) == len(P2) and top[0] is None
    base = base_of(eng, tiny_llama)
    adapter, _ = eng.resolve_weights(run_id="a", version=1)
    ref = full_logprobs(ref_logits(base, adapter, P2))  # [P, V]
    for t in range(1, len(P2)):
        pairs = top[t]
        assert len(pairs) == 5 and all(isinstance(i, int) for i, _ in pairs)
        vals = [v for _, v in pairs]
        assert vals == sorted(vals, reverse=True), "topk_prompt_logprobs not sorted descending"
        assert vals[0] >= r.prompt_logprobs[t] - 1e-6, "top-1 log-prob below the actual token's"
        want = torch.topk(ref[t - 1], 5)
        assert [i for i, _ in pairs] == want.indices.tolist(), f"top-k ids at prompt position {t} wrong (off by one?)"
        assert vals == pytest.approx(want.values.tolist(), abs=1e-4)


# ---- top-k / top-p ------------------------------------------------------------------------


def test_tiny_top_p_is_greedy(eng):
    g = eng.sample(P1, greedy(8), run_id="b", version=1).sequences[0]
    for seed in (0, 1, 2):
        r = eng.sample(P1, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=seed, stop=()),
                       run_id="b", version=1).sequences[0]
        assert r.tokens == g.tokens, "top_p=1e-6 must keep only the most likely token"


def test_top_k_and_top_p_restrict_the_choices(eng, tiny_llama):
    base = base_of(eng, tiny_llama)
    adapter, _ = eng.resolve_weights(run_id="a", version=1)
    r = eng.sample(P1, SamplingParams(max_tokens=8, temperature=2.0, top_k=5, seed=3, stop=(), num_samples=8),
                   run_id="a", version=1)
    ranks = []
    for s in r.sequences:
        logits = gen_logits(base, adapter, P1, s.tokens)
        order = torch.argsort(logits, dim=-1, descending=True)
        for step, tok in enumerate(s.tokens):
            rank = int((order[step] == tok).nonzero())
            assert rank < 5, f"top_k=5 sampled the rank-{rank} token"
            ranks.append(rank)
    assert len(set(ranks)) >= 3, "temperature 2 with top_k=5 always picked the same ranks: not sampling"
    # top_p: every sampled token lies in the smallest prefix (by probability at the temperature) reaching p.
    top_p, temp = 0.3, 1.0
    r = eng.sample(P1, SamplingParams(max_tokens=8, temperature=temp, top_p=top_p, seed=4, stop=(), num_samples=8),
                   run_id="a", version=1)
    for s in r.sequences:
        probs = torch.softmax(gen_logits(base, adapter, P1, s.tokens) / temp, -1)
        for step, tok in enumerate(s.tokens):
            before = float(probs[step][probs[step] > probs[step][tok]].sum())
            assert before < top_p + 1e-4, f"top_p={top_p} sampled a token outside the nucleus (mass before {before})"


# ---- continuous batching and memory ------------------------------------------------------


def test_continuous_batching(eng, tiny_llama):
    p1 = SamplingParams(max_tokens=14, temperature=1.0, seed=31, stop=())
    p2 = SamplingParams(max_tokens=4, temperature=1.0, seed=32, stop=(), num_samples=2)
    solo1 = eng.sample(P1, p1, base_model=tiny_llama).sequences[0]
    solo2 = eng.sample(P2, p2, run_id="a", version=1).sequences
    solo3 = eng.sample(P3, greedy(1), run_id="b", version=1).sequences[0]
    s = sampler_of(eng)
    r1 = eng.submit_sample(P1, p1, base_model=tiny_llama)
    eng.sample_step()
    eng.sample_step()
    assert len(s.rows) == 1 and len(s.rows[0].tokens) == 3
    r2 = eng.submit_sample(P2, p2, run_id="a", version=1)
    r3 = eng.submit_sample(P3, greedy(1), run_id="b", version=1)  # finishes in its prefill
    eng.sample_step()
    assert {id(row.request) for row in s.rows} == {id(r1), id(r2)}, "request 2 did not join the running batch"
    assert len(s.rows) == 3 and r3.done, "a one-token request must finish and leave in the step it starts"
    assert s.cache.rows == len(s.rows) and not r1.done
    steps = 0
    while not r1.done:
        was2 = r2.done
        eng.sample_step()
        steps += 1
        assert s.cache.rows == len(s.rows), "cache rows out of step with the running rows"
        if r2.done and not was2:
            assert len(s.rows) == 1 and s.rows[0].request is r1, "finished sequences did not leave at once"
    assert steps < 14 and s.idle
    assert r1.result.sequences[0].tokens == solo1.tokens and r1.result.sequences[0].logprobs == pytest.approx(
        solo1.logprobs, abs=1e-5), "the running request changed when another joined or left"
    for a, b in zip(r2.result.sequences, solo2):
        assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=1e-5), "joined request differs"
    assert r3.result.sequences[0].tokens == solo3.tokens


def test_memory_bounds(world, tiny_llama):
    e = Engine(max_sequences=4)
    e.models[tiny_llama] = world.models[tiny_llama]  # share the loaded weights
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=40 + i, stop=(), num_samples=2)
              for i, n in enumerate((5, 8, 6))]
    solo = [e.sample(P1, p, base_model=tiny_llama).sequences for p in params]
    reqs = [e.submit_sample(P1, p, base_model=tiny_llama) for p in params]
    s = sampler_of(e)
    e.sample_step()
    assert len(s.rows) == 4 and s.queue == [reqs[2]], "the third request must wait in the queue"
    seen_queue_steps = 1
    while e.sample_step():
        assert len(s.rows) <= 4, f"{len(s.rows)} rows running with max_sequences=4"
        if reqs[2] in s.queue:
            seen_queue_steps += 1
            assert reqs[2].result is None
    assert all(r.done for r in reqs)
    assert seen_queue_steps >= 4, "the third request started before rows were free"
    for r, want in zip(reqs, solo):
        assert [x.tokens for x in r.result.sequences] == [x.tokens for x in want], "queued request differs from solo"
    # Cached tokens: a request larger than the whole cache is refused; two that do not fit together queue.
    e = Engine(max_cached_tokens=40)
    e.models[tiny_llama] = world.models[tiny_llama]
    with pytest.raises(InvalidInput) as err:
        e.submit_sample(P1, SamplingParams(max_tokens=15, num_samples=3), base_model=tiny_llama)  # 3*21 > 40
    assert err.value.field == "max_tokens"
    a = e.submit_sample(P1, greedy(20), base_model=tiny_llama)  # 26 tokens
    b = e.submit_sample(P3, greedy(12), base_model=tiny_llama)  # 14 tokens: 40 in all, fits
    c = e.submit_sample(P3, greedy(12), base_model=tiny_llama)  # would be 54: waits
    s = sampler_of(e)
    e.sample_step()
    assert s.queue == [c], "admission ignores max_cached_tokens"
    while e.sample_step():
        assert sum(len(r.request.prompt) + r.request.params.max_tokens for r in s.rows) <= 40
    assert a.done and b.done and c.done
    # Prefill tokens per step: prompts arriving together are admitted over several steps (at least one
    # request a step), and each gives the same tokens as alone.
    e = Engine(max_prefill_tokens=len(P1) + len(P3))
    e.models[tiny_llama] = world.models[tiny_llama]
    solo = [e.sample(p, greedy(4), base_model=tiny_llama).sequences[0].tokens for p in (P1, P3, P1, P3)]
    reqs = [e.submit_sample(p, greedy(4), base_model=tiny_llama) for p in (P1, P3, P1, P3)]
    s = sampler_of(e)
    e.sample_step()
    assert s.queue == reqs[2:], "one step prefilled more than max_prefill_tokens"
    while e.sample_step():
        pass
    assert [r.result.sequences[0].tokens for r in reqs] == solo


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt"),
    ([1, VOCAB], SamplingParams(), "prompt"),
    ([1, -1], SamplingParams(), "prompt"),
    ([1, 2.0], SamplingParams(), "prompt"),
    ([1] * 10, SamplingParams(max_tokens=503), "max_tokens"),
    ([1], SamplingParams(max_tokens=0), "max_tokens"),
    ([1], SamplingParams(temperature=-0.1), "temperature"),
    ([1], SamplingParams(temperature=float("nan")), "temperature"),
    ([1], SamplingParams(top_p=0.0), "top_p"),
    ([1], SamplingParams(top_p=1.5), "top_p"),
    ([1], SamplingParams(top_k=-2), "top_k"),
    ([1], SamplingParams(num_samples=0), "num_samples"),
    ([1], SamplingParams(num_samples=257), "num_samples"),
    ([1], SamplingParams(seed=-1), "seed"),
    ([1], SamplingParams(topk_prompt_logprobs=101), "topk_prompt_logprobs"),
    ([1], SamplingParams(stop=("",)), "stop"),
    ([1], SamplingParams(stop=(-1,)), "stop"),
    ([1], SamplingParams(stop=(VOCAB,)), "stop"),
    ([1], SamplingParams(stop=([],)), "stop"),
    ([1], SamplingParams(stop=([5, VOCAB],)), "stop"),
    ([1], SamplingParams(stop=(1.5,)), "stop"),
    ([1], SamplingParams(stop=(None,)), "stop"),
    ([1], SamplingParams(top_k=VOCAB + 1), "top_k"),  # torch.topk beyond V failed the whole batch
    ([1], SamplingParams(top_k=2.5), "top_k"),
    ([1], SamplingParams(top_k=True), "top_k"),
    ([1], SamplingParams(max_tokens=True), "max_tokens"),
    ([1], SamplingParams(num_samples=True), "num_samples"),
    ([1], SamplingParams(seed=True), "seed"),
    ([1], SamplingParams(temperature=True), "temperature"),
    ([1], SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
    ([1], SamplingParams(topk_prompt_logprobs=True), "topk_prompt_logprobs"),
    ([1], SamplingParams(stop=(True,)), "stop"),
])
def test_validation_errors(eng, tiny_llama, prompt, params, field):
    with pytest.raises(InvalidInput) as err:
        eng.submit_sample(prompt, params, base_model=tiny_llama)
    assert err.value.field == field, f"wrong field for {params!r}: {err.value.field} ({err.value.message})"
    assert not any(s.queue for s in eng.samplers.values()), "a rejected request was queued"


def test_validation_boundaries_and_versions(eng, tiny_llama):
    base = base_of(eng, tiny_llama)
    validate([1] * 10, SamplingParams(max_tokens=502), base.config, 256)  # exactly the context: allowed
    validate([VOCAB - 1], SamplingParams(top_p=1.0, temperature=0.0, num_samples=256, stop=("x", 3, [4, 5])),
             base.config, 256)
    validate([1], SamplingParams(top_k=VOCAB), base.config, 256)  # the whole vocabulary: allowed, and it samples
    assert len(eng.sample([1], SamplingParams(max_tokens=2, top_k=VOCAB, seed=3, stop=()),
                          base_model=tiny_llama).sequences[0].tokens) == 2
    with pytest.raises(InvalidInput) as err:
        validate([1], SamplingParams(num_samples=5), base.config, 4)
    assert err.value.field == "num_samples"
    e = Engine(max_sequences=4)
    e.models[tiny_llama] = base
    with pytest.raises(InvalidInput) as err:
        e.submit_sample([1], SamplingParams(num_samples=5), base_model=tiny_llama)
    assert err.value.field == "num_samples", "num_samples above the engine's max_sequences must be refused"
    with pytest.raises(NotFound) as nf:
        eng.submit_sample(P1, SamplingParams(), run_id="a", version=99)
    assert nf.value.field == "version"
    with pytest.raises(InvalidInput) as err:
        eng.submit_sample(P1, SamplingParams(), run_id="a")
    assert err.value.field == "version"
    with pytest.raises(NotFound) as nf:
        eng.submit_sample(P1, SamplingParams(), run_id="nope", version=1)
    assert nf.value.field == "run_id"



# ---- one request's failure is its own ----------------------------------------------------------


BAD_SEED, BAD_PROMPT = 666, [1, 4242, 4242, 4242]
GOOD = [(P1, SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=(), num_samples=2), {"run_id": "a"}),
        (P2, SamplingParams(max_tokens=8, temperature=0.7, top_k=50, seed=12, stop=()), {"run_id": "b"}),
        (P3, greedy(5, prompt_logprobs=True), {"run_id": "a"})]


def concerns_bad(x, min_tokens: int) -> bool:
    """Whether an argument concerns the bad request (once a row of it holds min_tokens tokens): the
    request, one of its rows, a list of them, or a prompt batch [R, P] holding its prompt."""
    if isinstance(x, list):
        return any(concerns_bad(y, min_tokens) for y in x)
    if isinstance(x, torch.Tensor):
        return x.dtype == torch.int64 and x.dim() == 2 and any(r[:4].tolist() == BAD_PROMPT for r in x)
    request = getattr(x, "request", x)
    seed = getattr(getattr(request, "params", None), "seed", None)
    return seed == BAD_SEED and len(getattr(x, "tokens", [])) >= min_tokens


def inject_failure(monkeypatch, name: str, min_tokens: int) -> None:
    """sampler.<name> (a function or a Sampler method) raises whenever called about the bad request."""
    from whitney.engine.sampling import sampler

    owner = sampler if hasattr(sampler, name) else sampler.Sampler
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        if any(concerns_bad(a, min_tokens) for a in args):
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


@pytest.mark.parametrize("name,min_tokens", [
    ("next_tokens", 0),  # its first token's choice, in the prefill
    ("next_tokens", 2),  # a later choice, in the shared decode batch
    ("_prompt_logprobs", 0),  # its own prompt log-probs
    ("_prompt_pass", 0),  # the shared prompt pass: retried per request
    ("_stop_reason", 2),  # its stop check (the tokenizer)
])
def test_a_failing_request_fails_alone(eng, monkeypatch, name, min_tokens):
    """A request whose own work raises gets that error and leaves the batch; the requests sampled in the
    same prefill and decode batch finish exactly as alone (tokens, log-probs, prompt log-probs: their
    generators and cache rows were not disturbed), and the sampler serves on."""
    solo = [eng.sample(p, sp, version=1, **w) for p, sp, w in GOOD]
    inject_failure(monkeypatch, name, min_tokens)
    bad_params = SamplingParams(max_tokens=6, temperature=1.0, seed=BAD_SEED, stop=(), num_samples=3,
                                prompt_logprobs=True)
    good = [eng.submit_sample(p, sp, version=1, **w) for p, sp, w in GOOD[:2]]
    bad = eng.submit_sample(BAD_PROMPT, bad_params, run_id="b", version=1)
    good.append(eng.submit_sample(GOOD[2][0], GOOD[2][1], version=1, **GOOD[2][2]))
    s = sampler_of(eng)
    eng.sample_step()
    assert not s.queue, "the requests were not prefilled together"
    while not all(r.done for r in [*good, bad]):
        eng.sample_step()
    assert isinstance(bad.error, RuntimeError), f"the failing request has no error: {bad.error!r}"
    for r, ref in zip(good, solo):
        assert r.error is None, r.error
        assert [x.tokens for x in r.result.sequences] == [x.tokens for x in ref.sequences], \
            "a request beside a failing one sampled differently"
        for x, y in zip(r.result.sequences, ref.sequences):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert (r.result.prompt_logprobs is None) == (ref.prompt_logprobs is None)
    assert good[2].result.prompt_logprobs[1:] == pytest.approx(solo[2].prompt_logprobs[1:], abs=1e-5)
    assert s.idle and s.cache.rows == 0 and s._pending_tokens.numel() == 0, "the failed rows stayed behind"
    monkeypatch.undo()
    again = eng.sample(GOOD[1][0], GOOD[1][1], version=1, **GOOD[1][2])
    assert [x.tokens for x in again.sequences] == [x.tokens for x in solo[1].sequences]


def test_engine_sample_raises_the_requests_own_error(eng, tiny_llama, monkeypatch):
    inject_failure(monkeypatch, "next_tokens", 0)
    with pytest.raises(RuntimeError, match="injected"):
        eng.sample(BAD_PROMPT, SamplingParams(max_tokens=3, seed=BAD_SEED), base_model=tiny_llama)
    assert sampler_of(eng).idle
