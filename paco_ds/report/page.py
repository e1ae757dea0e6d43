"""`python -m paco_ds.report runs/<name>`: one self-contained HTML page for a run.

Read top to bottom, the page answers: did the rewards rise (each reward on its own panel and
scale, with first -> last, the change and the best epoch stated), what do the samples look like
(the first and the latest grids side by side, the eval grids with their prompts), is training
sound (ratio, clip fraction, advantages, phase times), and what ran (the final metrics and the
config). Curves are matplotlib PNGs embedded as base64, so the page is one file to mail around.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Training panels after the rewards: (title, y label, keys). train/loss is left out: it is
# policy_loss + kl_beta * kl, which the two panels already show.
TRAIN_PANELS = [
    ("Policy loss", "loss", ["train/policy_loss"]),
    ("KL to the base model", "KL", ["train/kl"]),
    ("Importance ratio", "ratio", ["train/ratio", "train/ratio_first"]),
    ("Clip fraction", "fraction", ["train/clipfrac", "train/clipfrac_gt_one", "train/clipfrac_lt_one"]),
    ("Advantages", "value", ["adv/adv_abs_mean", "adv/global_std", "adv/zero_std_ratio"]),
    ("Gradient norm", "norm", ["train/grad_norm"]),
    ("Phase times", "seconds", ["time/sample", "time/reward_wait", "time/train", "time/eval"]),
    ("Throughput", "images per device-second", ["throughput/images_per_device_sec"]),
    ("Model FLOPs utilisation", "fraction of the device's peak", ["throughput/mfu"]),
]

HEALTHY = """
<p>The tiny recipes run random-weight models built offline, so <b>their images are noise and stay
noise</b>: nothing on this page should look like a picture. What a healthy tiny run shows:</p>
<ul>
<li>the <b>combined training reward rises</b> from the first epochs to the last, by a little (each
epoch's value is noisy: compare the averages of the first and last epochs, not two single epochs);
single rewards may move either way, and the tiny judge's consistency score barely moves (the
judge is random too);</li>
<li>the <b>evaluation reward</b> (ODE samples on the same test prompts and seeds each time) moves
the same way;</li>
<li>the <b>importance ratio stays close to 1</b> and the clip fraction near 0 (the policy changes
a little per step), the policy loss stays near 0 (GRPO advantages are centred: its value is not
a measure of progress);</li>
<li>no masked or failed rewards and no non-finite steps.</li>
</ul>
"""

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em 2em;max-width:1400px;color:#222}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
.panels{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:10px}
.panels figure{margin:0;border:1px solid #e3e3e3;padding:4px;background:#fff}
.panels img{width:100%} figcaption{font-size:.85em;color:#444;padding:2px 4px}
table{border-collapse:collapse;font-size:.9em} td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:right}
td:first-child,th:first-child{text-align:left}
.up{color:#1a7f37} .down{color:#b42318} .box{background:#f6f8fa;border:1px solid #ddd;padding:.4em 1.2em}
.verdict{font-weight:600} .sbs{display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start}
.sbs figure{margin:0} .sbs img{image-rendering:pixelated;width:360px;max-width:100%;border:1px solid #ddd}
ol.prompts{font-size:.85em;max-width:1100px} ol.prompts li{margin:2px 0}
pre{background:#f6f8fa;padding:1em;font-size:.8em;overflow:auto;max-height:30em}
"""


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(epoch, value) of the rows that logged `key` (an eval key exists only where an eval ran)."""
    return [(int(r["epoch"]), float(r[key])) for r in rows if "epoch" in r and _finite(r.get(key))]


def reward_names(rows: list[dict], prefix: str) -> list[str]:
    """`reward/<name>/mean` keys (or `eval/...`), the combined reward first, then by name; reward
    parts (`reward/<reward>/<part>/mean`) come after the reward they belong to."""
    keys = {k for r in rows for k in r if k.startswith(prefix) and k.endswith("/mean")}
    return sorted(keys, key=lambda k: (k != f"{prefix}combined/mean", k))


def change(points: list[tuple[int, float]]) -> dict | None:
    """First -> last, the change, the best epoch, and the averages of the first and last thirds
    (at most 3 epochs each), which single noisy epochs do not swing."""
    if not points:
        return None
    vals = [v for _, v in points]
    n = max(1, min(3, len(vals) // 3))
    best = max(points, key=lambda p: p[1])
    return {"first": points[0], "last": points[-1], "delta": vals[-1] - vals[0], "best": best,
            "head": sum(vals[:n]) / n, "tail": sum(vals[-n:]) / n, "n": n, "count": len(points)}


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _signed(v: float) -> str:
    cls = "up" if v > 0 else "down" if v < 0 else ""
    return f'<span class="{cls}">{v:+.4g}</span>'


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)  # tight_layout() already fits the labels: "tight" would draw twice
    return base64.b64encode(buf.getvalue()).decode()


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reward_panel(key: str, points: list[tuple[int, float]], eval_only: bool) -> str:
    """One reward on its own y scale; first and last points marked. Eval points are joined only
    across the epochs where an evaluation ran (nothing is drawn in between)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.6, 2.7))
    xs, ys = zip(*points)
    ax.plot(xs, ys, marker="o", ms=4 if eval_only else 3, lw=1.5, color="#1f77b4")
    ax.scatter([xs[0], xs[-1]], [ys[0], ys[-1]], s=36, color=["#888", "#d62728"], zorder=3)
    name = key.removesuffix("/mean")
    ax.set_xlabel("epoch")
    ax.set_ylabel(name.split("/", 1)[1])
    ax.grid(alpha=0.3)
    ax.margins(y=0.15)
    fig.tight_layout()
    b64 = _png(fig)
    plt.close(fig)
    return b64


def metric_panel(title: str, ylabel: str, rows: list[dict], keys: list[str]) -> str | None:
    plt = _plt()
    drawn = [(k, series(rows, k)) for k in keys]
    drawn = [(k, pts) for k, pts in drawn if pts]
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(4.6, 2.7))
    for k, pts in drawn:
        sparse = len(pts) < len({int(r["epoch"]) for r in rows if "epoch" in r}) // 2
        ax.plot(*zip(*pts), marker="o", ms=3, lw=0 if sparse else 1.2, label=k)  # sparse: points only
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, framealpha=0.6)
    fig.tight_layout()
    b64 = _png(fig)
    plt.close(fig)
    return b64


def latest_video(run_dir: Path, prefix: str, label: str) -> list[str]:
    """The latest animated grid of `prefix` (a video run's samples) as one more panel beside the
    reward panels, so the scores and what they score are seen together; none for image runs."""
    videos = [p for p in _images(run_dir, prefix) if p.suffix == ".webp"]
    if not videos:
        return []
    p = videos[-1]
    b64 = base64.b64encode(p.read_bytes()).decode()
    return [f'<figure><img alt="{html.escape(p.name)}" src="data:{MEDIA[p.suffix]};base64,{b64}">'
            f"<figcaption>{label}, epoch {_epoch_of(p)} (latest; each tile one video)</figcaption></figure>"]


def reward_section(rows: list[dict], prefix: str, title: str, note: str, beside: list[str] = ()) -> list[str]:
    """The rewards of `prefix` on their own panels, a table of their changes, and `beside`: more
    figures in the same grid (a video run's latest samples)."""
    keys = reward_names(rows, prefix)
    if not keys:
        return []
    out = [f"<h2>{title}</h2><p>{note}</p>",
           "<table><tr><th>reward</th><th>first (epoch)</th><th>last (epoch)</th><th>change</th>"
           "<th>best (epoch)</th><th>average of the first → last epochs</th></tr>"]
    figures = []
    for k in keys:
        c = change(series(rows, k))
        if c is None:
            continue
        name = k.removesuffix("/mean").split("/", 1)[1]
        out.append(f"<tr><td>{html.escape(name)}</td><td>{_fmt(c['first'][1])} ({c['first'][0]})</td>"
                   f"<td>{_fmt(c['last'][1])} ({c['last'][0]})</td><td>{_signed(c['delta'])}</td>"
                   f"<td>{_fmt(c['best'][1])} ({c['best'][0]})</td>"
                   f"<td>{_fmt(c['head'])} → {_fmt(c['tail'])} ({_signed(c['tail'] - c['head'])}, "
                   f"{c['n']} each)</td></tr>")
        b64 = reward_panel(k, series(rows, k), eval_only=prefix == "eval/")
        cap = (f"<b>{html.escape(name)}</b>: {_fmt(c['first'][1])} → {_fmt(c['last'][1])} "
               f"({_signed(c['delta'])}), best {_fmt(c['best'][1])} at epoch {c['best'][0]}")
        figures.append(f'<figure><img alt="{html.escape(prefix + name)}" src="data:image/png;base64,{b64}">'
                       f"<figcaption>{cap}</figcaption></figure>")
    out.append("</table>")
    out.append('<div class="panels">' + "".join(figures + list(beside)) + "</div>")
    return out


def verdict(rows: list[dict]) -> str:
    """The run against the healthy-run description: the combined reward's trend and the counters
    that must stay at zero."""
    lines = []
    c = change(series(rows, "reward/combined/mean"))
    if c is not None and c["count"] >= 2:
        rising = c["tail"] > c["head"]
        lines.append(f"combined training reward, average of the first {c['n']} epochs → last {c['n']}: "
                     f"{_fmt(c['head'])} → {_fmt(c['tail'])} ({_signed(c['tail'] - c['head'])}): "
                     + ("<span class='up'>rising</span>" if rising else "<span class='down'>not rising</span>"))
    for key in reward_names(rows, "eval/"):
        e = change(series(rows, key))
        if e is not None and e["count"] >= 2:
            lines.append(f"evaluation {html.escape(key.removesuffix('/mean').split('/', 1)[1])}, first → last "
                         f"evaluation: {_fmt(e['first'][1])} → {_fmt(e['last'][1])} ({_signed(e['delta'])})")
    for key, what in (("reward/masked", "masked rewards"), ("reward/failures", "reward failures"),
                      ("train/nonfinite_steps", "non-finite steps")):
        total = sum(v for _, v in series(rows, key))
        if series(rows, key):
            lines.append(f"{what}: {total:g}" + ("" if total == 0 else " <span class='down'>(should be 0)</span>"))
    ratio = series(rows, "train/ratio")
    if ratio:
        worst = max(abs(v - 1) for _, v in ratio)
        lines.append(f"importance ratio: largest distance from 1 over the epochs {worst:.2g}")
    return "<ul class='verdict'>" + "".join(f"<li>{x}</li>" for x in lines) + "</ul>" if lines else ""


def _images(run_dir: Path, prefix: str) -> list[Path]:
    """A run's grids of `prefix` by epoch: PNG images, or animated WebP videos (a video family's)."""
    return sorted(p for p in (run_dir / "images").glob(f"{prefix}_epoch*.*") if p.suffix in MEDIA)


MEDIA = {".png": "image/png", ".webp": "image/webp"}  # an animated WebP plays in <img> like a GIF


def _epoch_of(path: Path) -> int:
    return int(path.stem.rsplit("epoch", 1)[1])


def _recipe(run_dir: Path) -> dict:
    import yaml

    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def eval_prompts(run_dir: Path, recipe: dict) -> list[str]:
    """The prompts of the eval grid: the recipe's first test.num_images test prompts, in file
    order (the evaluation shows prompt i at tile i, with the same seed at every evaluation)."""
    data = recipe.get("data") or {}
    name = data.get("test_file")
    if not name:
        return []
    path = Path(name)
    for base in (Path.cwd(), REPO_ROOT, run_dir):
        if not path.is_absolute() and (base / path).is_file():
            path = base / path
            break
    if not path.is_file():
        return []
    try:
        from paco_ds.data import load_prompts

        items = load_prompts(path, data.get("format", "t2is"))
    except Exception:  # noqa: BLE001 - the page is still useful without the prompts
        return []
    limit = data.get("max_test_prompts") or len(items)
    n = (recipe.get("test") or {}).get("num_images", len(items))
    return [it.prompt for it in items[:min(limit, n)]]


def side_by_side(paths: list[Path], label: str) -> str:
    first, last = paths[0], paths[-1]
    shown = [first] if first == last else [first, last]
    figs = []
    for p in shown:
        b64 = base64.b64encode(p.read_bytes()).decode()
        figs.append(f'<figure><img alt="{html.escape(p.name)}" src="data:{MEDIA[p.suffix]};base64,{b64}">'
                    f"<figcaption>{label} epoch {_epoch_of(p)}{' (first)' if p == first else ' (latest)'}"
                    f"</figcaption></figure>")
    return '<div class="sbs">' + "".join(figs) + "</div>"


def samples_section(run_dir: Path, recipe: dict) -> list[str]:
    out = []
    evals, train = _images(run_dir, "eval"), _images(run_dir, "train_samples")
    if evals:
        editing = (recipe.get("data") or {}).get("format") == "edit"
        layout = ("each row: the reference, then the edit" if editing else
                  "tiles left to right, then top to bottom")
        out.append("<h2>Evaluation samples: first and latest</h2>"
                   f"<p>The same test prompts and seeds at every evaluation (ODE sampling), so the two "
                   f"grids differ only by training; {layout}, in the order of the prompts below.</p>")
        out.append(side_by_side(evals, "evaluation"))
        prompts = eval_prompts(run_dir, recipe)
        if prompts:
            out.append("<ol class='prompts'>" + "".join(f"<li>{html.escape(p)}</li>" for p in prompts) + "</ol>")
    if train:
        out.append("<h2>Training samples: first and latest</h2>"
                   "<p>Rollouts of that epoch (SDE sampling, prompts drawn per epoch), each captioned "
                   "with its combined reward.</p>")
        out.append(side_by_side(train, "training"))
    return out


def final_metrics(rows: list[dict]) -> list[str]:
    """The last training epoch's metrics and, apart, the last evaluation's (a run ends with an
    eval-only row, which alone would hide the final training rewards)."""
    out = []
    trained = [r for r in rows if "reward/combined/mean" in r or "train/policy_loss" in r]
    evaluated = [r for r in rows if any(k.startswith("eval/") for k in r)]
    for title, row, pick in (("Final training epoch", trained[-1] if trained else None,
                              lambda k: not k.startswith("eval/")),
                             ("Final evaluation", evaluated[-1] if evaluated else None,
                              lambda k: k.startswith("eval/") or k == "time/eval")):
        if row is None:
            continue
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v) if _finite(v) else html.escape(str(v))}</td></tr>"
                        for k, v in row.items() if k == "epoch" or pick(k))
        out.append(f"<h3>{title} (epoch {row.get('epoch')})</h3><table>{cells}</table>")
    return out


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    recipe = _recipe(run_dir)
    model = recipe.get("model") or {}
    epochs = sorted({int(r["epoch"]) for r in rows if "time/epoch" in r})
    evals = sorted({int(r["epoch"]) for r in rows if any(k.startswith("eval/") for k in r)})
    what = f"{model.get('family', '?')}" + (" (tiny, random weights)" if model.get("tiny") else
                                           f" ({html.escape(str(model.get('path', '')))})")
    parts = [f"<h1>{html.escape(run_dir.name)}</h1>",
             f"<p>{what}; {len(epochs)} training epochs logged"
             + (f" ({epochs[0]}-{epochs[-1]})" if epochs else "")
             + (f"; evaluations at epochs {', '.join(map(str, evals))}" if evals else "") + ".</p>",
             "<h2>Is this run healthy?</h2><div class='box'>" + (HEALTHY if model.get("tiny") else "")
             + "<p><b>This run:</b></p>" + verdict(rows) + "</div>"]
    parts += reward_section(rows, "reward/", "Train rewards",
                            "Each reward on its own scale, per epoch: the mean over that epoch's rollouts "
                            "(SDE samples). <i>combined</i> is what the advantages are computed from "
                            "(the recipe's weighted aggregation).",
                            latest_video(run_dir, "train_samples", "training rollouts"))
    parts += reward_section(rows, "eval/", "Evaluation rewards",
                            "The test reward set on the test prompts (ODE samples at the test resolution), "
                            "at the epochs where an evaluation ran.", latest_video(run_dir, "eval", "evaluation"))
    parts += samples_section(run_dir, recipe)
    figures = []
    for title, ylabel, keys in TRAIN_PANELS:
        b64 = metric_panel(title, ylabel, rows, keys)
        if b64:
            figures.append(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{b64}"></figure>')
    if figures:
        parts.append("<h2>Training</h2><div class='panels'>" + "".join(figures) + "</div>")
    parts.append("<h2>Final metrics</h2>")
    parts += final_metrics(rows)
    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        parts.append(f"<h2>Config</h2><pre>{html.escape(cfg.read_text())}</pre>")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(run_dir.name) +
            f"</title><style>{CSS}</style></head><body>" + "\n".join(parts) + "</body></html>")
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
