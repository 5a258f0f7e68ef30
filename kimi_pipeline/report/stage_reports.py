"""Per-stage reports: one renderer per pipeline (DAG) stage, from the section that stage writes to
summary.json. Pure functions of plain dicts (no Prefect, no Ray, no torch): the Prefect tasks turn
them into artifacts, the library writes some of them to files (DIR/cluster/facts.md).

`summary.md` is rendered separately (`kimi_pipeline.report.markdown.render_summary`): it lists every
section generically, one bullet per key, rather than with these per-stage layouts.

The training actor layout (`kimi_pipeline.rl.actor_layout.layout_markdown`) is rendered next to its type.
"""

from __future__ import annotations

from typing import Any


def _dash(v: Any, fmt: str = "") -> str:
    """None as an em dash, else `v` (formatted with `fmt` when given)."""
    if v is None:
        return "—"
    return format(v, fmt) if fmt else str(v)


def _dash_float(v: Any, fmt: str = ".3g") -> str:
    """None as an em dash, floats formatted with `fmt`, anything else as str."""
    return "—" if v is None else (format(v, fmt) if isinstance(v, float) else str(v))


def download_report(section: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of a table (not markdown): each source, where it came from and where it landed."""
    return [
        {"source": name, "from": s["source"], "path": s["path"], "bytes": s["bytes"]}
        for name, s in section.items()
        if isinstance(s, dict) and "source" in s
    ]


def validate_report(section: dict[str, Any]) -> str:
    lines = ["# Data validation", "", "| split | rows | bad rows | bad % | reasons |", "|---|---|---|---|---|"]
    for split in ("train", "eval"):
        s = section.get(split) or {}
        lines.append(f"| {split} | {s.get('rows', 0)} | {s.get('bad_rows', 0)} | {100 * s.get('bad_fraction', 0):.2f} | "
                     f"{', '.join(f'{k}: {v}' for k, v in (s.get('reasons') or {}).items()) or '—'} |")
    c = section.get("contamination") or {}
    lines += ["", f"**Contamination**: {c.get('overlap', 0)}/{c.get('eval_rows', 0)} eval prompts also in train.", ""]
    examples = [(split, e) for split in ("train", "eval") for e in (section.get(split) or {}).get("examples", [])]
    if examples:
        lines += ["## Example bad rows", "", "| split | line | reasons | raw |", "|---|---|---|---|"]
        for split, e in examples[:10]:
            raw = e["raw"][:120].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {split} | {e['line']} | {'; '.join(e['reasons'])} | `{raw}` |")
    return "\n".join(lines)


def convert_report(s: dict[str, Any]) -> str:
    rss = s.get("peak_rss_mb_per_rank") or []
    lay, vlay = s.get("layout") or {}, s.get("verify_layout") or {}
    lines = [
        "# HF → Megatron torch_dist conversion",
        "",
        "| figure | value |",
        "|---|---|",
        f"| nodes × ranks | {s.get('nodes')} × {s.get('ranks_per_node')} (tp {lay.get('tp')}, pp {lay.get('pp')}, ep {lay.get('ep')}) |",
        f"| source format | {s.get('source_format')} |",
        f"| source bytes | {s.get('bytes', 0) / 2**20:.1f} MiB → {s.get('output_bytes', 0) / 2**20:.1f} MiB torch_dist |",
        f"| conversion time | {_dash(s.get('seconds'))} s ({(s.get('bytes_per_second') or 0) / 2**20:.1f} MiB/s) |",
        f"| peak RSS per rank | {', '.join(f'{x:.0f}' for x in rss)} MiB |",
        f"| verified | **{s.get('verified')}**" + (f" (skipped: {s['verify_skipped']})" if s.get("verify_skipped") else "") + " |",
        f"| verify layout | world {vlay.get('world_size', '—')}, tp {vlay.get('tp', '—')}, pp {vlay.get('pp', '—')}, ep {vlay.get('ep', '—')} |",
        f"| tensors compared / max abs diff | {_dash(s.get('tensors_compared'))} / {_dash(s.get('max_abs_diff'))} |",
        f"| HF → Megatron → HF round trip | {_dash(s.get('roundtrip_tensors'))} tensors, exact: {_dash(s.get('roundtrip_exact'))} |",
        f"| logits max diff (tolerance) | {_dash(s.get('logits_max_diff'), '.3g') if s.get('logits_max_diff') is not None else '—'}"
        f" ({_dash(s.get('logits_tolerance'))}) |",
        f"| checkpoint | `{s.get('path')}` |",
        "",
        "On a cluster, the same job runs on every node as:",
        "",
        f"```\n{s.get('command', '')}\n```",
    ]
    return "\n".join(lines)


def cluster_report(section: dict[str, Any]) -> str:
    """Also written as DIR/cluster/facts.md by the cluster stage."""
    lines = [
        f"# Ray cluster ({section['mode']})",
        "",
        f"- address: `{section['address']}`  (Ray {section['ray_version']}, auth {section['auth_mode']})",
        f"- required: {section['required']}",
        f"- total: {section['nodes']} node(s), {section['cpus']:g} CPU, {section['gpus']:g} GPU, {section['memory_gb']:g} GB",
    ]
    if section.get("dashboard"):
        lines.append(f"- dashboard: {section['dashboard']}")
    if section.get("temp_dir"):
        lines.append(f"- temp dir: `{section['temp_dir']}`" + (f" — {section['temp_dir_note']}" if section.get("temp_dir_note") else ""))
    if section.get("preflight"):
        p = section["preflight"]
        lines.append(f"- preflight (fast, {p['seconds']} s): " + ("passed" if p["ok"] else "FAILED: " + "; ".join(p["failed"]))
                     + " — `preflight.md` beside this file")
    lines += ["", "| node | head | CPU | GPU | memory GB | other resources |", "|---|---|---|---|---|---|"]
    for n in section.get("node_list", []):
        other = ", ".join(f"{k}={v:g}" for k, v in sorted(n["resources"].items())) or "—"
        lines.append(
            f"| {n['ip']}/{n['node_id'][:8]} | {'yes' if n['is_head'] else ''} | {n['cpus']:g} | {n['gpus']:g} | "
            f"{n['memory_gb']:.1f} | {other} |"
        )
    return "\n".join(lines) + "\n"


def train_report(section: dict[str, Any]) -> str:
    return "\n".join([
        "# GRPO training", "",
        f"steps **{section['steps']}** · reward first 10 % {section['reward_first']:.3f} → last 10 % "
        f"**{section['reward_last']:.3f}** · {section['seconds_per_step']:.2f} s/step", "",
        f"checkpoint: `{section['checkpoint']}`", f"metrics: `{section['metrics']}`",
    ])


def eval_report(result: dict[str, Any], table: list[dict[str, Any]] | None = None, limit: int = 30) -> str:
    """One evaluation (a row of eval.jsonl) and the first `limit` rows of its per-problem table."""
    lines = [f"# Evaluation on {result.get('eval_set', 'the eval set')} at step {result['step']}", "",
             f"avg@{result['n']} **{result['avg_at_n']:.3f}** · pass@1 {result['pass_at_1']:.3f} · "
             f"pass@{result['n']} {result['pass_at_n']:.3f} · maj@{result['n']} {result['maj_at_n'] or 0:.3f} · "
             f"{result['problems']} problems", ""]
    if table:
        keys = [k for k in ("label", "correct", "avg", "maj_answer", "prompt", "example") if k in table[0]]
        lines += ["| # | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for i, row in enumerate(table[:limit]):
            cells = [str(row.get(k, ""))[:60].replace("|", "\\|").replace("\n", " ") for k in keys]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _served_rows(ev: dict[str, Any] | None, published: bool | None) -> list[str]:
    """The export scored as it is served (`eval.served`): its scores beside the training eval's."""
    if not ev:
        return []
    if "skipped" in ev:
        return [f"| served eval | skipped: {ev['skipped']} |"]
    rows = [f"| served eval ({ev.get('engine')} engine, step {ev.get('step')}, {ev.get('problems')} problems) | "
            f"avg@n {_dash_float(ev.get('avg_at_n'))}, pass@1 {_dash_float(ev.get('pass_at_1'))}, "
            f"pass@n {_dash_float(ev.get('pass_at_n'))} |"]
    if ev.get("training_avg_at_n") is not None:
        rows.append(f"| drop from the training eval (bound) | {_dash_float(ev.get('drop'))} "
                    f"(avg@n {_dash_float(ev.get('training_avg_at_n'))} in training; {ev.get('max_drop')}) |")
    rows.append(f"| published | **{published}** |")
    return rows


def export_report(s: dict[str, Any]) -> str:
    if "skipped" in s:
        return f"# INT4 export\n\nSkipped: {s['skipped']}"
    mib = 2**20
    lines = [
        "# INT4 export (compressed-tensors pack-quantized, Kimi-K2-Thinking format)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| checkpoint | `{s.get('checkpoint')}` |",
        f"| export | `{s.get('path')}` ({s.get('shards')} shards) |",
        f"| size | {s.get('int4_bytes', 0) / mib:.2f} MiB INT4 vs {s.get('bf16_bytes', 0) / mib:.2f} MiB bf16 "
        f"(×{s.get('compression')}) |",
        f"| written by | {s.get('ranks', 1)} rank(s), peak RSS per rank "
        f"{', '.join(f'{mb:.0f}' for mb in s.get('peak_rss_mb_per_rank') or []) or '—'} MB |",
        f"| routed-expert Linears packed | {s.get('num_quantized')} of {s.get('num_tensors')} tensors, "
        f"group {s.get('group_size')} |",
        f"| dequantized == fake-quant (exact) | **{s.get('dequant_exact')}** "
        f"(reloaded model: {s.get('experts_equal')}) |",
        f"| logits max diff vs {s.get('logits_reference', 'trainer')} (tolerance) | {_dash_float(s.get('logits_max_diff'))} "
        f"({_dash_float(s.get('logits_tolerance'))}) |",
        f"| … of which: decode / bf16 storage / HF↔trainer | {_dash_float(s.get('logits_max_diff_exact'))} / "
        f"{_dash_float(s.get('logits_max_diff_storage'))} / {_dash_float(s.get('logits_max_diff_parity'))} |",
        f"| top-1 agreement with the trainer | {_dash_float(s.get('top1_agreement'))} |",
        f"| reloaded model generates | {s.get('generated_tokens')} tokens: `{s.get('generated_text')}` |",
    ]
    if s.get("model_check"):
        lines.append(f"| model check | {s['model_check']} |")
    lines += _served_rows(s.get("eval"), s.get("published"))
    if s.get("note"):
        lines += ["", s["note"]]
    if s.get("problems"):
        lines += ["", "## Problems", *[f"- {p}" for p in s["problems"]]]
    return "\n".join(lines)
