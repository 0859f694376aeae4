"""Render docs/BENCHMARKS.md and docs/bench_*.png from bench/results/*.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

ORDER = ["overhead", "sharing", "memory", "sampling", "latency", "scaling", "fairness", "soak", "hostile", "cluster",
         "peers", "general", "busy", "tenants", "capacity", "vllm", "sharded", "ha"]


def load(results_dir: Path) -> dict[str, dict]:
    """Every result present, in ORDER; a benchmark's variants (capacity-rank8.json: `--rank`) after it."""
    out = {}
    for name in ORDER:
        for path in [results_dir / f"{name}.json", *sorted(results_dir.glob(f"{name}-*.json"))]:
            if path.exists():
                out[path.stem] = json.loads(path.read_text())
    return out


def verdict(c: dict) -> str:
    if c.get("target") is None:
        return "info"
    if c.get("ratio") is None:
        return "**not measured**"
    r, t = c["ratio"], c["target"]
    ok = {"<=": r <= t, ">=": r >= t, "<": r < t, ">": r > t}[c["op"]]
    return "**pass**" if ok else "**miss**"


def fmt(x, unit: str | None = None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if unit == "ms":
        return f"{x:.1f} ms"
    if unit == "exponent":
        return f"{x:.2f}"
    if unit == "MB":
        return f"{x:.0f} MB"
    if unit in ("errors", "ops", "ops/s"):
        return f"{x:g} {unit}" if unit != "ops/s" else f"{x:.1f} ops/s"
    return f"{x:.2f}x"


def absolute(name: str, r: dict) -> str:
    """The absolute figures behind a benchmark's ratios, one short line."""
    if "error" in r:
        return f"error: {r['error']}"
    if name == "overhead":
        s = r["seconds_per_step"]
        return ", ".join(f"{k} {v:.2f} s/step ({r['tokens_per_s'][k]:.0f} tok/s)" for k, v in s.items())
    if name == "sharing":
        out = ", ".join(f"{k} {v:.0f} tok/s ({r['seconds_per_round'][k]:.1f} s)" for k, v in r["tokens_per_s"].items())
        c = r.get("ceiling")
        if c:
            out += (f"; in-process forward_backward of all runs: mixed batch {c['seconds']['mixed']:.2f} s, one call "
                    f"each {c['seconds']['separate']:.2f} s; matmul {c['matmul_gflops']['all_rows']:.0f} vs "
                    f"{c['matmul_gflops']['one_run_rows']:.0f} GFLOP/s")
        return out
    if name == "busy":
        return "; ".join(f"{k}: idle {v['idle']:.2f} s/step, one core busy {v['busy']:.2f} s/step "
                         f"({r['busy_over_idle'][k]:.2f}x), sampling {r['sampled_tokens_per_s'][k]['idle']:.0f} -> "
                         f"{r['sampled_tokens_per_s'][k]['busy']:.0f} tok/s" for k, v in r["seconds_per_step"].items())
    if name == "memory":
        peaks = {int(k): v for k, v in r["peak_rss_mib"].items()}
        few, many = min(peaks), max(peaks)
        extra = (peaks[many] - peaks[few]) / (many - few) if many > few else float("nan")
        return (", ".join(f"{k} run(s): {v:.0f} MiB" for k, v in peaks.items())
                + f"; {extra:.0f} MiB per extra run (an idle run that has stepped holds its adapter and two "
                f"AdamW moments: 3 float32 copies of its LoRA weights; gradients exist only between "
                f"forward_backward and optim_step)")
    if name == "sampling":
        return ", ".join(f"{k} {v:.1f} tok/s" for k, v in r["tokens_per_s"].items())
    if name == "latency":
        return (f"wake-up p50 {r['wakeup']['p50_ms']:.1f} / p90 {r['wakeup']['p90_ms']:.1f} ms "
                f"(n={r['wakeup']['n']}, missed {r['wakeup']['missed']}); round trip p50 "
                f"{r['round_trip']['p50_ms']:.1f} / p90 {r['round_trip']['p90_ms']:.1f} ms (n={r['round_trip']['n']})")
    if name == "scaling":
        by_len = ", ".join(f"{k}: {v:.2f}s" for k, v in r["step_seconds_by_length"].items())
        by_batch = ", ".join(f"{k}: {v:.2f}s" for k, v in r["step_seconds_by_batch"].items())
        per_tok = ", ".join(f"{k}: {v:.1f}" for k, v in r["sampling_ms_per_token"].items())
        return (f"step by length (batch 1) {by_len}; by batch (length {r['settings']['length_for_batches']}) "
                f"{by_batch}; sampling ms/token by concurrency {per_tok}")
    if name == "fairness":
        phases = []
        for phase in ("alone", "contended"):
            x = r[phase]
            phases.append(f"{phase}: small forward_backward p50 {x['forward_backward']['p50_s']:.2f} s / p99 "
                          f"{x['forward_backward']['p99_s']:.2f} s (n={x['forward_backward']['n']})")
        big = r["contended"].get("big_forward_backward")
        if big:
            phases.append(f"largest batch p50 {big['p50_s']:.1f} s (n={big['n']})")
        if r["contended"].get("big_forward_backward_unfinished"):
            phases.append("the largest batch was still running at its fair share when the phase ended")
        return "; ".join(phases)
    if name == "soak":
        rss = r["rss_mib"]
        return (f"{r['operations']} operations, {r['operations_per_s']:.1f}/s, {r['n_errors']} errors; RSS "
                f"{rss[0][1]:.0f} -> {rss[-1][1]:.0f} MiB; " + ", ".join(
                    f"{k} p50 {v['p50_s']:.2f} / p99 {v['p99_s']:.2f} s" for k, v in r["latency"].items()))
    if name == "hostile":
        parts = []
        for phase in ("alone", "hostile"):
            fb, seen, h = (r[phase].get("forward_backward"), r[phase].get("forward_backward_client"),
                           r["healthz"][phase])
            parts.append(f"{phase}: well-behaved forward_backward "
                         + (f"p50 {fb['p50_s']:.2f} s / p99 {fb['p99_s']:.2f} s (n={fb['n']}; as the clients see it "
                            f"p99 {seen['p99_s']:.2f} s)" if fb and seen else "none done")
                         + f", /healthz p99 {fmt_s(h['p99_s'])} (max {fmt_s(h['max_s'])})")
        parts.append(f"server RSS growth in the hostile phase {fmt_s(r['rss_growth_mb'], 'MB')}")
        parts.append("hostile answers: " + ", ".join(
            f"{a} {' '.join(f'{n}x{code}' for code, n in sorted(x['answers'].items()))} (max {x['max_s']:.2f} s)"
            for a, x in r["hostile_answers"].items()))
        return "; ".join(parts)
    if name == "cluster":
        load = {k: r[k]["under_load"] for k in ("inprocess", "ray_replica")}
        return (f"optim_step p50 in-process {r['inprocess']['trivial_p50_ms']:.1f} ms, Ray "
                f"{r['ray']['trivial_p50_ms']:.1f} ms; SFT in-process {r['inprocess']['sft_tokens_per_s']:.0f} tok/s, "
                f"Ray {r['ray']['sft_tokens_per_s']:.0f} tok/s; under training load: sample p50 in-process "
                f"{load['inprocess']['sample_p50_s']:.2f} s (n={load['inprocess']['samples']}, training "
                f"{load['inprocess']['train_tokens_per_s']:.0f} tok/s), Ray with a replica "
                f"{load['ray_replica']['sample_p50_s']:.2f} s (n={load['ray_replica']['samples']}, training "
                f"{load['ray_replica']['train_tokens_per_s']:.0f} tok/s)")
    if name == "peers":
        parts = []
        for who, x in r["results"].items():
            if "missing" in x:
                parts.append(f"{who}: not measured ({x['missing'][:200]})")
                continue
            parts.append(f"{who}: (a) {x.get('a_tokens_per_s_median', '-')} tok/s (median step "
                         f"{x.get('a_median_step_s', '-')} s), (b) {x.get('b_tokens_per_s_median', '-')} tok/s, "
                         f"(c) p50 {x.get('c_median_ms', '-')} ms / p90 {x.get('c_p90_ms', '-')} ms "
                         f"(SDK {x.get('sdk', '?')}, load {x.get('loadavg_start', '?')})")
        return "; ".join(parts)
    if name == "general":
        parts = []
        for kind, x in r["families"].items():
            if "error" in x:
                parts.append(f"{kind}: failed ({x['error'][:200]})")
                continue
            s, t = x["seconds_per_step"], x["tokens_per_s"]
            parts.append(f"{kind}: SFT {s['whitney']:.2f} vs PEFT {s['peft']:.2f} s/step; sampling {t['whitney']:.1f} "
                         f"(LoRA {t['whitney_lora']:.1f}) vs HF {t['hf_batch']:.1f} tok/s")
        return "; ".join(parts)
    if name == "tenants":
        parts = []
        for row in r["summary"]:
            who = f"{row['model']} {row['contender']} ({row['client']})"
            if "missing" in row:
                parts.append(f"{who}: not measured ({row['missing'][:200]})")
                continue
            phase = f" over {row['phase_s']:.0f} s" if row.get("phase_s") else ""
            parts.append(f"{who}: {row['ops_per_s']:.2f} ops/s{phase}, p50 {row['p50_s']:.2f} / p99 {row['p99_s']:.2f} s, "
                         f"sample p50 {fmt_s(row['sample_p50_s'])} / p99 {fmt_s(row['sample_p99_s'])}, "
                         f"{row['errors']} errors")
        return "; ".join(parts)
    if name == "vllm":
        wave = list(r["whitney"]["waves"])[-1]
        names = [n for n in ("whitney", "vllm", "vllm_all_cores") if n in r]
        return (f"{wave.replace('x', ' x ')} tokens over {r['settings']['runs']} LoRA versions: " + ", ".join(
            f"{n} {r[n]['waves'][wave]['lora']['tokens_per_s']:.0f} tok/s" for n in names)
            + "; every figure in the tables below")
    if name == "sharded":
        t, m = r["throughput"], r["load_rss"]
        return (f"training {t['tokens_s']['1']:.0f} tok/s on 1 rank, {t['tokens_s']['2']:.0f} tok/s on 2 "
                f"({t['median_step_s']['1']:.2f} / {t['median_step_s']['2']:.2f} s per step); loading with every "
                f"weight resident: unsharded {m['unsharded_peak_mib']:.0f} MiB, each of 2 ranks "
                f"{m['per_rank_peak_mib']:.0f} MiB, a process that only imported torch and whitney "
                f"{m['baseline_imports_only_mib']['VmRSS']:.0f} MiB; right after load_model (the unsharded file only "
                f"mapped) {m['after_load']['unsharded_peak_mib']:.0f} / {m['after_load']['per_rank_peak_mib']:.0f} MiB")
    if name == "ha":
        f, t = r["failover"], r["throughput"]
        return (f"{f['kills']} leader kills (lease {f['lease_seconds']:g} s): failover "
                + ", ".join(f"{x:.2f}" for x in f["failover_s"]) + f" s (p50 {f['p50_s']:.2f} s); "
                f"{f['acknowledged']} operations acknowledged meanwhile, {f['lost']} lost, "
                f"{f['failed_worker_lost']} failed with worker_lost (running on the killed leader); "
                f"{t['1']['clients']} clients: {t['1']['ops_per_s']:.1f} ops/s through one API process, "
                f"{t['2']['ops_per_s']:.1f} through two ({t['1']['errors'] + t['2']['errors']} errors)")
    if name.startswith("capacity"):
        s = r["summary"]
        return (f"{s['runs_reached']} of {s['runs_target']} runs ({s['stopped']}); RSS one run "
                f"{s['rss_one_run_mib']:.0f} MiB, all paged out {fmt_s(s['rss_after_creation_settled_mib'], 'MiB')}, "
                f"peak while active {fmt_s(s['rss_peak_active_mib'], 'MiB')}; page-in p50 "
                f"{fmt_s(s['page_in_p50_ms'], 'ms')}, {fmt_s(s['mib_per_paged_run'], 'MiB')} per paged run; baseline: "
                f"{s['baseline_runs_reached']} runs ({s['baseline_stopped']}), "
                f"{s['baseline_rss_per_run_mib']:.0f} MiB per run, RSS {s['baseline_rss_mib']:.0f} MiB")
    return ""


def vllm_tables(r: dict) -> list[str]:
    """bench/vllm_sampling.py's figures: a table per measurement, Whitney's sampler against each vLLM setting."""
    if "error" in r:
        return []
    w, names = r["whitney"], [n for n in ("vllm", "vllm_all_cores") if n in r]
    head = " | ".join(f"{n} | {n} / Whitney" for n in names)
    rule = "| --- | --- |" + " --- | --- |" * len(names)

    def row(label: str, get, unit: str, digits: int = 1) -> str:
        a = get(w)
        cells = " | ".join(f"{get(r[n]):.{digits}f} {unit} | {get(r[n]) / a:.2f}x" for n in names)
        return f"| {label} | {a:.{digits}f} {unit} | {cells} |"

    def both(x: dict) -> str:
        return f"{x['equal']:.2f} ({x['mean_prefix']:.2f})"

    lines = ["", f"LoRA rank {r['settings']['rank']}, {r['dtype']}, CPU {r['lscpu']['model_name']} (AVX-512 BF16: "
             f"{r['lscpu']['avx512_bf16']}); vllm: vLLM's default CPU binding (one core kept for its scheduler), "
             "vllm_all_cores: VLLM_CPU_NUM_OF_RESERVED_CPU=0. Server start: "
             + ", ".join(f"{n} {r[n]['start_s']:.0f} s" for n in ["whitney", *names]) + ".", "",
             f"| sampling | Whitney | {head} |", rule]
    for wave, kinds in w["waves"].items():
        for kind in kinds:
            label = wave.replace("x", " x ") + (" base" if kind == "base" else f" {r['settings']['runs']} LoRA")
            lines += [row(f"{label}: tokens/s", lambda x, k=kind, v=wave: x["waves"][v][k]["tokens_per_s"], "tok/s"),
                      row(f"{label}: TTFT p50", lambda x, k=kind, v=wave: 1000 * x["waves"][v][k]["ttft_p50_s"],
                          "ms", 0)]
    lines += ["", f"| new version (p50 of {r['settings']['saves']}) | Whitney | {head} |", rule,
              row("submit save_weights_for_sampler -> its result", lambda x: 1000 * x["swap"]["save_p50_s"], "ms", 0),
              row("submit save_weights_for_sampler -> first token sampled on it", lambda x: 1000 * x["swap"]["p50_s"],
                  "ms", 0),
              "", f"| agreement ({r['settings']['agreement']} tokens) | Whitney | " + " | ".join(names) + " |",
              "| --- | --- |" + " --- |" * len(names)]
    for kind in ("base", "lora"):
        for stat in ("max", "mean"):
            lines.append(f"| {kind}: {stat} abs(sampled log-prob - compute_logprobs) | "
                         f"{w['logprob_gap'][kind][stat]:.2e} | "
                         + " | ".join(f"{r[n]['logprob_gap'][kind][stat]:.2e}" for n in names) + " |")
    lines += ["| greedy samples equal to Whitney's (mean equal prefix), base | 1.00 (itself) | "
              + " | ".join(both(r[n]["greedy_base"]) for n in names) + " |",
              "| greedy samples equal to Whitney's (mean equal prefix), LoRA version vs its state checkpoint | "
              f"{both(w['greedy_lora'])} | " + " | ".join(both(r[n]["greedy_lora"]) for n in names) + " |"]
    return lines


def fmt_s(x, unit: str = "s") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f} {unit}" if unit == "s" \
        else f"{x:.0f} {unit}"


def settings(r: dict) -> str:
    """A result's settings as key=value, a measurement's own settings (a dict) as its name's list in brackets."""
    s = r.get("settings", {})
    return ", ".join(f"{k}=[{settings({'settings': v})}]" if isinstance(v, dict) else f"{k}={v}" for k, v in s.items())


def plots(results: dict[str, dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        made.append(name)

    def bars(ax, labels, values, ylabel, title):
        ax.bar(labels, values, color=["#4C72B0", "#DD8452", "#55A868", "#C44E52"][:len(labels)])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)

    def bar_plot(name: str, labels, values, ylabel: str, title: str, width: float = 5) -> None:
        fig, ax = plt.subplots(figsize=(width, 3.2))
        bars(ax, list(labels), list(values), ylabel, title)
        save(fig, f"bench_{name}.png")

    ok = {name: r for name, r in results.items() if "error" not in r}
    if "overhead" in ok:
        r, st = ok["overhead"], ok["overhead"]["settings"]
        bar_plot("overhead", r["seconds_per_step"], r["seconds_per_step"].values(), "seconds per step (median)",
                 f"SFT step, {st['batch']} x {st['seq_len']} tokens, LoRA r{st['rank']}")
    if "sharing" in ok:
        r = ok["sharing"]
        bar_plot("sharing", r["tokens_per_s"], r["tokens_per_s"].values(), "aggregate tokens/s (median)",
                 f"{r['settings']['runs']} runs at once vs one after another")
    if "memory" in ok:
        r = ok["memory"]
        bar_plot("memory", [f"{k} run(s)" for k in r["peak_rss_mib"]], r["peak_rss_mib"].values(),
                 "server peak RSS (MiB)", f"whitney serve, LoRA r{r['settings']['rank']}, one step each")
    if "sampling" in ok:
        r = ok["sampling"]
        bar_plot("sampling", r["tokens_per_s"], r["tokens_per_s"].values(), "generated tokens/s (median)",
                 f"{r['requests']} requests x {r['new_tokens']} new tokens", width=5.5)
    r = results.get("latency")
    if r and "error" not in r:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        data = [r["raw_ms"]["wakeup"] or [float("nan")], r["raw_ms"]["round_trip"] or [float("nan")]]
        ax.boxplot(data)
        ax.set_xticks([1, 2], ["long-poll wake-up", "GET capabilities"])
        ax.axhline(20, color="red", linestyle="--", linewidth=1, label="target p50 20 ms")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.set_title("latency of the machinery", fontsize=10)
        save(fig, "bench_latency.png")
    r = results.get("scaling")
    if r and "error" not in r:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
        for ax, key, xlabel, ylabel, exp in [
            (axes[0], "step_seconds_by_length", "sequence length (batch 1)", "step seconds", r["exponent_length"]),
            (axes[1], "step_seconds_by_batch", f"batch (length {r['settings']['length_for_batches']})",
             "step seconds", r["exponent_batch"]),
            (axes[2], "sampling_ms_per_token", "concurrent sequences", "ms per generated token", None),
        ]:
            xs = [int(k) for k in r[key]]
            ys = list(r[key].values())
            ax.plot(xs, ys, "o-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if exp is not None:
                ax.set_title(f"exponent {exp:.2f}", fontsize=10)
            else:
                ax.set_title(f"wall time exponent {r['exponent_sampling']:.2f}", fontsize=10)
        save(fig, "bench_scaling.png")
    r = results.get("peers")
    if r and "error" not in r:
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
        who = [k for k, x in r["results"].items() if "missing" not in x]
        for ax, key, ylabel, title in [
            (axes[0], "a_tokens_per_s_median", "tokens/s (median)", "(a) SFT, r32, 8 x 128, pipelined"),
            (axes[1], "b_tokens_per_s_median", "tokens/s (median)", "(b) 16 samples x 64 tokens"),
            (axes[2], "c_median_ms", "ms (p50)", "(c) trivial forward round trip"),
        ]:
            bars(ax, who, [r["results"][k].get(key, float("nan")) for k in who], ylabel, title)
        save(fig, "bench_peers.png")
    r = results.get("general")
    if r and "error" not in r:
        fams = {k: x for k, x in r["families"].items() if "error" not in x}
        if fams:
            fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(fams)), 3.4))
            xs = range(len(fams))
            ax.bar([i - 0.2 for i in xs], [x["sft_ratio"] for x in fams.values()], 0.4, label="SFT step, Whitney / PEFT")
            ax.bar([i + 0.2 for i in xs], [x["sampling_ratio"] for x in fams.values()], 0.4,
                   label="sampling tok/s, Whitney / HF batched")
            ax.axhline(1.0, color="red", linestyle="--", linewidth=1)
            ax.set_xticks(list(xs), list(fams), rotation=30, fontsize=8)
            ax.set_ylabel("ratio (SFT: <= 1 good; sampling: >= 1 good)", fontsize=8)
            ax.legend(fontsize=7)
            ax.set_title("general path per family", fontsize=10)
            save(fig, "bench_general.png")
    return made


def render(results_dir: Path, docs_dir: Path, quick: bool = False) -> Path:
    results = load(results_dir)
    docs_dir.mkdir(parents=True, exist_ok=True)
    images = plots(results, docs_dir)
    m = next((r["machine"] for r in results.values() if "machine" in r), {})
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`python -m bench`; `bench/run.py`, one module per benchmark in `bench/`) from "
        "`bench/results/*.json`. Do not edit by hand." + (" **Quick smoke run: tiny settings, not the real figures.**"
                                                        if quick else ""),
        "",
        "Every comparison is measured side by side in one run, the contenders alternating within each round; "
        "figures are medians over rounds. Absolute times are shown, but the targets are ratios (latency: "
        "absolute p50). Model: the embedded SmolLM2-135M-Instruct. The server is `whitney serve` in its own "
        "process on the same machine.",
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu', '?')}, {m.get('cores', '?')} cores (bfloat16 matmuls in hardware, AVX-512 BF16 or AMX: {m.get('avx512_bf16', '?')})",
        f"- torch {m.get('torch', '?')} ({m.get('torch_threads', '?')} threads), Python {m.get('python', '?')}",
        "- dtype of every side of each comparison (Whitney's compute dtype, and HF/PEFT's load dtype): "
        + ", ".join(f"{n}: {r.get('dtype', r.get('settings', {}).get('dtype', '?'))}" for n, r in results.items())
        + ". In bfloat16 mode Whitney keeps LoRA weights, gradients, optimizer state, log-probs and losses in "
        "float32 (PEFT keeps its adapters in float32 too).",
        "- load average (1/5/15 min) when each benchmark started and ended, since other processes may share "
        "the CPU (and the machine, where a benchmark last ran on another one than the above):",
    ]
    for name, r in results.items():
        la, lb = r.get("machine", {}).get("load_average"), r.get("load_average_after")
        own = {k: r.get("machine", {}).get(k) for k in ("cpu", "cores", "avx512_bf16")}
        other = ("" if own == {k: m.get(k) for k in own} else f"; on {own['cpu']}, {own['cores']} cores, "
                 f"bfloat16 matmuls in hardware: {own['avx512_bf16']}")
        if la and lb:
            lines.append(f"  - {name}: {' / '.join(f'{x:.2f}' for x in la)} -> {' / '.join(f'{x:.2f}' for x in lb)} "
                         f"({r.get('elapsed_s', 0):.0f} s, finished {r.get('finished_at', '?')}{other})")
    lines += ["", "## Results", "", "| measured | ratio | target | result |", "| --- | --- | --- | --- |"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name}: **failed** ({r['error']}) | - | - | **miss** |")
        for c in r.get("checks", []):
            target = "-" if c.get("target") is None else f"{c['op']} {fmt(c['target'], c.get('unit'))}"
            served = " ".join(r.get("settings", {}).get("serve_args") or [])  # a run with other `serve` flags says so
            label = f"({served}) {c['name']}" if served else c["name"]
            lines.append(f"| {label} | {fmt(c.get('ratio'), c.get('unit'))} | {target} | {verdict(c)} |")
    lines += ["", "## Absolute figures (medians) and settings", ""]
    for name, r in results.items():
        lines += [f"### {name}", "", f"- {absolute(name, r)}", f"- settings: {settings(r)}"]
        if name == "vllm":
            lines += vllm_tables(r)
        if f"bench_{name}.png" in images:
            lines += ["", f"![{name}](bench_{name}.png)"]
        lines.append("")
    lines += [
        "## How each figure is measured",
        "",
        "- **overhead**: N SFT steps (forward_backward with cross_entropy summed over tokens, then optim_step: AdamW "
        "lr 1e-4, betas 0.9/0.95, eps 1e-12) through `whitney.Client` against the server (forward_backward and "
        "optim_step submitted back to back, both awaited each step), the same steps in-process through `Engine`, "
        "and a plain Hugging Face + PEFT loop (LoRA r=alpha=32 on q,k,v,o,gate,up,down and lm_head, "
        "`torch.optim.AdamW`) on the same datums. Target: HTTP <= 1.05x plain.",
        "- **sharing**: 4 runs, each its own client in its own thread, training at once (batch 2 x 128) against the "
        "same 4 runs one after another; aggregate tokens/s. Target >= 1.3x.",
        "- **memory**: a fresh `whitney serve` per measurement; peak RSS (VmHWM from /proc/PID/status) after 1 or "
        "8 runs (rank 32) took one step each, the steps awaited one at a time. Target 8 runs <= 1.15x of 1.",
        "- **sampling**: 16 requests of 64 new tokens (EOS disabled) sent at once through the server, against "
        "HF `generate` per request (rate measured on the first 4 requests one by one: per-request generation "
        "does not get faster with more requests) and HF `generate` batched with left padding; the in-process "
        "engine alongside for reference. Targets >= 3x and >= 1.0x.",
        "- **latency**: wake-up = client receive time minus the operation's `finished_at` for a small "
        "forward_backward the client was already long-polling; round trip = `GET /v1/training/capabilities`. "
        "Target p50 < 20 ms each.",
        "- **scaling**: in-process engine; step time vs sequence length and batch size, sampling time per token "
        "vs concurrent sequences; exponent = least-squares slope of log time vs log size.",
        "- **fairness**: `whitney serve` on a tiny model (2 layers, 64 wide); 31 clients loop forward_backward "
        "(4 x 64) + optim_step, alone and then while one more client submits the largest allowed batch back to "
        "back; latency = the operation's created_at -> finished_at on the server. Target: small clients' p99 "
        "with / without <= 3.",
        "- **soak**: 32 clients on the tiny model for 3 minutes: forward_backward + optim_step, every 4th step a "
        "sampler version and an 8-token sample. Targets: zero errors; server RSS growth after the first third "
        "<= 5%.",
        "- **hostile** (issue 31): `whitney serve` on the tiny model and a tiny Qwen3-VL, two keys; the fairness "
        "workload (31 clients, forward_backward 4 x 64 + optim_step) alone, then beside one hostile tenant (its own "
        "process at nice 19, so its client-side work is not counted as the server's) sending, "
        "one thread per attack, back to back: a custom loss over its work budget (250 x logsumexp of a 65536-wide "
        "expand, 12 one-token datums) and the same paid for within it ([511, 10] targets), progressive JPEGs of "
        "2,010 scans (text and vision model) and of 64 scans at 4096 x 4096 (vision; each image other bytes), "
        "expected_tokens=10^9, a "
        "Tinker protobuf forward_backward with sparse [10^6, 256] weights, a Tinker asample with sparse "
        "target_prompt_logprobs [10^5, 100], 3 MiB of lone-surrogate JSON to /healthz without a key, 300-level "
        "user_metadata. Targets: well-behaved p99 (created_at -> finished_at) with / without <= 3; zero 5xx over "
        "all clients; server RSS growth (VmRSS) during the hostile phase < 300 MB.",
        "- **cluster**: `whitney serve` in-process and `--backend ray` (local Ray, the trainer an actor with both "
        "CPUs), both up, their calls alternated one at a time: optim_step p50 (target: Ray at most 5 ms more) "
        "and SFT 8 x 128 tokens/s (target Ray >= 0.95x); then, one after the other, sampling 16 tokens while "
        "another client trains, in-process (interleaved) vs Ray with one sampler replica (trainer and replica "
        "one CPU each): the sample's p50 and the training tokens/s meanwhile (info).",
        "- **peers** (`make bench-peers`, after `../shared/peers/skyrl/setup.sh`): `../shared/peers/bench_sdk.py` "
        "through the official SDK against `whitney serve` (SDK 0.38, LoRA clients with train_unembed=False as "
        "SkyRL trains no unembedding adapter) and against SkyRL tx 0.4.0 (JAX, float32, its pinned SDK 0.25; "
        "`run_bench.sh`, 2 adapter slots): (a) SFT rank 32, 8 x 128 tokens, pipelined, median over 10 steps; "
        "(b) 16 concurrent samples of 64 tokens, median over 3 waves; (c) forward of 1 x 8 tokens, p50 of 20. "
        "Targets >= 1.2x, >= 2x, < 20 ms.",
        "- **general**: per general-path family (tests/models.py `GENERAL_KINDS` but the composite checkpoints), a "
        "random model of 4 layers, hidden 256, heads of 64, MLP 512 (MoE: 8 experts of 128, top 2), the SmolLM2 "
        "tokenizer's 49152-token vocabulary, in-process `Engine` (not HTTP): (a) SFT steps (forward_backward + "
        "optim_step, 8 x 128 tokens, LoRA r=alpha=16 on every adaptable module and lm_head) against HF + PEFT "
        "with the run's own exported adapter loaded trainable (same modules) and `torch.optim.AdamW`; (b) 8 chat "
        "prompts x 32 new tokens at temperature 1 on the base weights against HF `generate` batched with left "
        "padding (and with a LoRA adapter, info). Targets: SFT <= 1.0x, sampling >= 1.0x.",
        "- **busy**: the same SFT step (SmolLM2, 4 x 128 tokens, rank 32, forward_backward + optim_step submitted "
        "back to back) through `whitney serve`, on an idle machine and while another process keeps one core busy "
        "(a Python loop), idle and busy rounds alternating on one server per setting: the default thread policy "
        "(`--threads auto`: the CPUs other processes leave free, engine/threads.py), threads fixed at the CPUs "
        "(the old default), and `--threads 1`; then 4 greedy samples of 32 tokens from the base model the same way "
        "(tokens/s). A busy round starts after the other process has run for 1 s, an idle round 1 s after it "
        "ended; the one step that starts together with it is reported apart (the engine sees a new load only "
        "from its next call on). Target: "
        "default SFT step busy <= 2x idle.",
        "- **tenants** (`--only tenants`, issue 15): 32 clients, each its own session and rank-8 run, loop "
        "forward_backward (4 x 64) + optim_step and every 8th step a sampler version and an 8-token sample, for "
        "90 s (or 4 times the warm-up, where longer: a round must fit several times) after an untimed warm-up step each, on the tiny model and on SmolLM2: against the commit before "
        "issue 15 (`--baseline REF`, served from `build/baseline-<sha>/`) and this tree, both through the native "
        "client, one fresh server after the other; and through the official SDK against SkyRL tx and this tree "
        "on SkyRL's copy of the same model, both for as long as this tree's native phase lasted, where SkyRL is "
        "set up (one adapter slot per client; stopped and reported as not held if its processes pass 14 GiB of "
        "RSS). Operations/s = operations done before the deadline / the phase's seconds; latency = created_at -> "
        "finished_at on the server (and client-observed). Targets "
        "(current / baseline): operations/s >= 4x, p99 <= 0.25x, zero errors.",
        "- **capacity** (`--only capacity`, issue 15): SmolLM2, LoRA rank 32, runs created by 4 client threads and "
        "stepped once (forward_backward 1 x 64 + optim_step) up to 1,000 or until a guard (server RSS 8 GiB, "
        "available memory 4 GiB, 20 GiB of disk left for the paged files, time budget) stops it; RSS = VmRSS. This "
        "tree with `--page-idle-seconds 10`: RSS with one run, once all are paged out, and at its peak while 50 "
        "runs train from 50 clients for 60 s; page-in = a paged-out run's first forward (1 x 16) minus the same "
        "forward right after. The baseline (no paging): the runs it held and RSS per run. Targets: RSS (50 active) "
        "<= 2x one run's; page-in p50 <= 100 ms; 1,000 runs; zero errors. capacity-rank8 (`--only capacity --rank 8`): "
        "the same at LoRA rank 8, whose 1,000 paged runs (~32 GiB) fit a disk that rank 32's (~127 GiB) do not.",
        "- **vllm** (`--only vllm`, needs `make vllm-env`; bench/vllm_sampling.py): `whitney serve` (float32) without "
        "sampler replicas (Whitney's sampler), then with one vLLM replica (`--samplers 1 --sampler-engine vllm`), with "
        "vLLM's default CPU binding and on all cores, one server at a time: N chat prompts sent at once "
        "(temperature 1, seed i, no stop: exactly the new tokens) on the base weights and round robin over 8 runs' "
        "versions (rank 32, one SFT step each); tokens/s = new tokens / (first submit -> last result); TTFT = the "
        "same N requests as OpenAI completion streams, the time to the first token's event (each stream closed "
        "there); new version = submit save_weights_for_sampler (after an SFT step) -> a max_tokens=1 sample of it; "
        "agreement: the sampled tokens' log-probs against compute_logprobs (the trainer's), and greedy samples against "
        "Whitney's sampler (LoRA: a save_state package saved with the version, which Whitney's sampler serves).",
        "- **sharded** (`--only sharded`, issue 33; bench/sharded.py): a sharded, data-parallel trainer "
        "(`ShardedEngine`, gloo, float32, SmolLM2) on 2 ranks against 1 rank, one compute thread per rank, groups "
        "alternating: one step = forward_backward (cross_entropy, 32 x 128 tokens, and 16 x 128 as info; LoRA rank 32 "
        "on every module) + "
        "optim_step, after a warm-up step; tokens/s from rank 0's step times. Target >= 1.7x. Loading: peak RSS "
        "(VmHWM) of each rank loading the base and reading every weight it holds, against an unsharded Engine doing "
        "the same in a fresh process (an unsharded load only maps a float32 safetensors file; its pages count once "
        "read), net of a process that only imported torch and whitney. Target <= 0.72x.",
        "- **ha** (`--only ha`, issue 34; bench/ha.py): `whitney serve --ha` processes (in-process engines, the tiny "
        "Llama, lease 2 s) on a throwaway PostgreSQL. Failover: the leader killed with SIGKILL while a client keeps "
        "samples going through the follower; from the kill to the completion of the waiting client's next operation, "
        "p50 over several kills (the killed member started again as a follower each time); operations lost: "
        "acknowledged and never ended (target 0). Throughput: 32 clients looping forward_backward + optim_step on runs "
        "of their own through one API process, then spread over two; target >= 0.9x.",
        "",
    ]
    path = docs_dir / "BENCHMARKS.md"
    path.write_text("\n".join(lines + _kept_notes(path)))
    return path


NOTES = "## Notes moved from code comments"


def _kept_notes(path: Path) -> list[str]:
    """The hand-written notes section at the end of the rendered file (measurements moved out of code comments),
    carried over as it is: the results above are rendered, the notes are not."""
    text = path.read_text() if path.exists() else ""
    start = text.find(NOTES)
    return [] if start < 0 else [*text[start:].rstrip("\n").split("\n"), ""]
