"""PNG plots of a run, drawn from metrics.jsonl and eval.jsonl (people would rather look than read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kimi_pipeline.report.metrics_log import read_jsonl


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _figure(title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.set_xlabel("rollout step")
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def write_plots(run_dir: str | Path) -> dict[str, str]:
    """reward.png, eval.png, response_length.png, stability.png under DIR/plots; returns name → path."""
    run_dir = Path(run_dir)
    train = read_jsonl(run_dir / "train" / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval" / "eval.jsonl")
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    made: dict[str, str] = {}
    window = max(1, len(train) // 15)

    if train:
        plt, fig, ax = _figure("Rollout reward")
        xs, ys = _series(train, "reward_mean")
        ax.plot(xs, ys, color="tab:blue", alpha=0.35, label="reward mean")
        ax.plot(xs, _smooth(ys, window), color="tab:blue", label=f"moving mean ({window})")
        xs2, ys2 = _series(train, "solved_group_fraction")
        if xs2:
            ax.plot(xs2, _smooth(ys2, window), color="tab:green", linestyle="--", label="groups with a solve")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("reward")
        ax.legend(loc="best", framealpha=0.85)
        made["reward"] = str(_save(plt, fig, out_dir / "reward.png"))

        plt, fig, ax = _figure("Response length")
        xs, ys = _series(train, "response_len_mean")
        ax.plot(xs, ys, color="tab:purple", label="mean tokens")
        ax.set_ylabel("tokens")
        ax.legend(loc="best", framealpha=0.85)
        made["response_length"] = str(_save(plt, fig, out_dir / "response_length.png"))

        plt, fig, ax = _figure("Training stability")
        for key, color in (("kl", "tab:red"), ("clip_fraction", "tab:orange"), ("entropy", "tab:gray"),
                           ("grad_norm", "tab:brown"), ("mismatch_k3", "tab:cyan"),
                           ("mismatch_abs_logp_max", "tab:olive"),  # train/inference mismatch (rl/grpo.py)
                           ("routing_agreement", "tab:pink")):  # routing shared with the engine (rl/policy.py)
            xs, ys = _series(train, key)
            if xs:
                ax.plot(xs, ys, color=color, label=key)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.legend(loc="best", framealpha=0.85)
        made["stability"] = str(_save(plt, fig, out_dir / "stability.png"))

    if evals:
        plt, fig, ax = _figure("Evaluation")
        for key, color in (("avg_at_n", "tab:blue"), ("pass_at_n", "tab:green"), ("maj_at_n", "tab:orange")):
            xs, ys = _series(evals, key)
            if xs:
                ax.plot(xs, ys, marker="o", color=color, label=key)
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("accuracy")
        ax.legend(loc="best", framealpha=0.85)
        made["eval"] = str(_save(plt, fig, out_dir / "eval.png"))
    return made
