"""Per-epoch metrics to JSONL and TensorBoard (and W&B when asked and installed), images as PNG.

Only rank 0 writes. `metrics.jsonl` has one JSON object per line; `python -m paco_ds.report`
turns a run directory into an HTML page.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from PIL import Image

from paco_ds.errors import DataError
from paco_ds.storage import writing

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, wandb: bool = False,
                 project: str = "paco_ds", run_name: str = "run", config: dict | None = None, resume: bool = False):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "images").mkdir(exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"))
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                log.warning("logging.wandb is true but wandb is not installed; skipping W&B")
            else:
                self.wandb = wb.init(project=project, name=run_name, config=config, resume="allow" if resume else None)

    def truncate_after(self, epoch: int, key: str = "epoch") -> None:
        """On resume, drop lines whose `key` (the epoch, or e.g. the optimizer step) is >= `epoch`:
        they will be run again."""
        if not (self.enabled and self.path.is_file()):
            return
        lines = [l for l in self.path.read_text(errors="replace").splitlines() if l.strip()]
        rows = []
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(line)
                rows.append((line, row))
            except ValueError:
                if n < len(lines):  # only a kill mid-write explains a bad line, and it can only be the last
                    raise DataError(f"{self.path}:{n}: not a JSON object; the metrics file is damaged "
                                    "(fix or remove that line to resume)") from None
                log.warning("%s:%d: dropping a torn last line (the run was killed while writing it): %.60s",
                            self.path, n, line)
        keep = [line for line, row in rows if row.get(key, -1) < epoch]
        self.path.write_text("".join(l + "\n" for l in keep))
        if self.tb is not None:
            # TensorBoard's own rule for a restart: its events at steps >= `epoch` (the TensorBoard
            # step is `key`'s value) are hidden, so the re-run steps show once, not twice.
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=epoch)

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        clean = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        with writing(self.path, self.run_dir), self.path.open("a") as fh:
            fh.write(json.dumps(clean) + "\n")
        scalars = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def save_image(self, name: str, image: Image.Image, epoch: int) -> Path | None:
        if not self.enabled:
            return None
        path = self.run_dir / "images" / f"{name}_epoch{epoch:04d}.png"
        with writing(path, self.run_dir):
            image.save(path)
        if self.tb is not None:
            import numpy as np

            self.tb.add_image(name, np.asarray(image.convert("RGB")), epoch, dataformats="HWC")
        return path

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
