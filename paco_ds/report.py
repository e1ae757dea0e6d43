"""`python -m paco_ds.report runs/<name>`: one self-contained HTML page for a run.

Reward and training curves are drawn with matplotlib and embedded as PNG (base64), next to the
latest training and eval sample grids and the run's config, so the page can be mailed around.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path

PANELS = [
    ("Train rewards", lambda k: k.startswith("reward/") and k.endswith("/mean")),
    ("Eval rewards", lambda k: k.startswith("eval/") and k.endswith("/mean")),
    ("Policy loss and KL", lambda k: k in ("train/loss", "train/policy_loss", "train/kl")),
    ("Importance ratio", lambda k: k in ("train/ratio", "train/ratio_first")),
    ("Clip fraction", lambda k: k.startswith("train/clipfrac")),
    ("Advantages", lambda k: k in ("adv/adv_abs_mean", "adv/zero_std_ratio", "adv/global_std")),
    ("Phase times (s)", lambda k: k in ("time/sample", "time/reward_wait", "time/train", "time/eval")),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plot_curves(rows: list[dict]) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
    out = []
    for title, pick in PANELS:
        chosen = [k for k in keys if pick(k)]
        if not chosen:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        for k in chosen:
            pts = [(r["epoch"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=k)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        out.append((title, _png(fig)))
        plt.close(fig)
    return out


def _latest(images: Path, prefix: str) -> Path | None:
    found = sorted(images.glob(f"{prefix}_epoch*.png"))
    return found[-1] if found else None


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    parts = [f"<h1>{html.escape(run_dir.name)}</h1>",
             f"<p>{len([r for r in rows if 'time/epoch' in r])} epochs logged.</p>", "<h2>Curves</h2><div>"]
    for title, b64 in plot_curves(rows):
        parts.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{b64}">')
    parts.append("</div>")
    for prefix, title in (("train_samples", "Latest training samples (caption: aggregated reward)"),
                          ("eval", "Latest evaluation samples")):
        img = _latest(run_dir / "images", prefix)
        if img is not None:
            b64 = base64.b64encode(img.read_bytes()).decode()
            parts.append(f"<h2>{title}</h2><p>{html.escape(img.name)}</p>"
                         f'<img style="image-rendering:pixelated;max-width:100%" src="data:image/png;base64,{b64}">')
    last = rows[-1] if rows else {}
    parts.append("<h2>Last logged metrics</h2><table>" + "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:.6g}</td></tr>" if isinstance(v, float) else
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in last.items()) + "</table>")
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        parts.append(f"<h2>Config</h2><pre>{html.escape(cfg.read_text())}</pre>")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(run_dir.name) +
            "</title><style>body{font-family:sans-serif;margin:2em}img{margin:4px}td{padding:0 1em}</style></head><body>"
            + "\n".join(parts) + "</body></html>")
    out = run_dir / "report.html"
    out.write_text(page)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    try:
        out = write_report(args.run_dir)
    except FileNotFoundError as err:
        print(f"report: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(out)


if __name__ == "__main__":
    main()
