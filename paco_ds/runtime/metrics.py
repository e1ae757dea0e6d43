"""Per-epoch metrics to JSONL and TensorBoard (and Weights & Biases when the recipe asks), images as PNG.

Only rank 0 writes. `metrics.jsonl` has one JSON object per line; `python -m paco_ds.report`
turns a run directory into an HTML page. W&B gets what TensorBoard gets (the scalars, the sample
grids) at the same steps; its run id is kept in each checkpoint, so a resume continues that W&B run
(docs/recipes.md#weights--biases).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from paco_ds.runtime import processes
from paco_ds.errors import ConfigError, DataError, UserError
from paco_ds.runtime.storage import writing

if TYPE_CHECKING:
    from paco_ds.recipe.schema import WandbConfig

log = logging.getLogger(__name__)

# W&B's own processes: its service (started by wandb.init, a child of this process) and the
# service's system monitor.
WANDB_SERVICES = ("wandb-core", "wandb-symon")


def check_wandb(section: WandbConfig | None, key: str = "logging.wandb") -> None:
    """Before a run starts: a recipe that asks for W&B has the wandb package (else W&B would be
    missing from the run's start to its end, unseen until someone looks for it)."""
    if section is None or section.mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"config key '{key}': the wandb package is not installed (pip install wandb), or set "
                          f"{key}.mode=disabled")
    if section.dir:  # W&B writes <dir>/wandb/ from the first step: an unwritable place is one line now
        from paco_ds.runtime.storage import check_writable

        check_writable(Path(section.dir).resolve(), f"{key}.dir")


def exit_code_of(error: BaseException | None) -> int:
    """The status the process will end with when `error` ends the run (None: a normal end)."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        return error.code if isinstance(error.code, int) else 1
    return error.exit_code if isinstance(error, UserError) else 1


def own_wandb_run(meta: dict, checkpoint: Path, checkpoints: Path) -> str | None:
    """The W&B run a resume continues: the checkpoint's, when the checkpoint is one of this run
    directory's own (`checkpoints`); a checkpoint of another directory starts another run, with its
    own metrics.jsonl, TensorBoard events and W&B run."""
    same = Path(checkpoint).resolve().parent == Path(checkpoints).resolve()
    return meta.get("wandb_run_id") if same else None


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = self.wandb = None
        self.wandb_from = 0  # the first step W&B is sent: the steps its run already holds are not sent again
        self._rerun_last = -1  # the last step of the rows a resume dropped (they are run again)
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "images").mkdir(exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tb"))

    def open_wandb(self, section: WandbConfig | None, run_name: str, config: dict, run_id: str | None = None,
                   resume_at: int | None = None) -> None:
        """W&B beside TensorBoard (`section`: the recipe's logging.wandb): a new W&B run, or, on a resume
        at step `resume_at` (after `truncate_after`), the checkpoint's W&B run `run_id` continued.

        W&B refuses a step lower than one it holds, so the steps between the checkpoint and the last
        one the first pass logged (the rows `truncate_after` dropped) are not sent again: W&B keeps
        their first values, which an exact resume repeats (timings aside). With `section.rewind`, W&B
        truncates its run back to the checkpoint instead (`resume_from`), as TensorBoard's purge_step does."""
        if not self.enabled or section is None or section.mode == "disabled":
            return
        import wandb

        where = Path(section.dir).resolve() if section.dir else self.run_dir
        where.mkdir(parents=True, exist_ok=True)
        args = dict(project=section.project, entity=section.entity, name=section.name or run_name, mode=section.mode,
                    dir=str(where), config=config)
        rewind = bool(run_id and section.rewind and resume_at)  # at step 0 there is nothing to keep
        if rewind:
            args["resume_from"] = f"{run_id}?_step={resume_at - 1}"  # keep the steps before resume_at
        elif run_id:
            args |= dict(id=run_id, resume="allow")  # "allow": an offline run never synced is created
        try:
            self.wandb = wandb.init(**args)
        except wandb.errors.Error as err:
            services = processes.descendants(WANDB_SERVICES)
            wandb.teardown(exit_code=ConfigError.exit_code)  # the service it started goes with the run
            processes.stop_processes(services, timeout=10.0)
            raise ConfigError(f"config key 'logging.wandb': W&B could not start the run "
                              f"({' '.join(str(err).split())})") from None
        held = self._rerun_last if run_id and not rewind else -1  # a new W&B run holds nothing yet
        self.wandb_from = max(self.wandb.starting_step, held + 1)
        if run_id and resume_at is not None and self.wandb_from > resume_at:
            log.info("W&B run %s already holds steps %d-%d: they go to metrics.jsonl and TensorBoard again, "
                     "to W&B from step %d on", self.wandb.id, resume_at, self.wandb_from - 1, self.wandb_from)

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (kept in checkpoints, so that a resume continues it), or None."""
        return self.wandb.id if self.wandb is not None else None

    def truncate_after(self, epoch: int, key: str = "epoch") -> None:
        """On resume, drop lines whose `key` (the epoch, or e.g. the optimizer step) is >= `epoch`:
        they will be run again."""
        if not self.enabled:
            return
        if self.path.is_file():
            self._truncate_lines(epoch, key)
        if self.tb is not None:
            # TensorBoard's own rule for a restart: its events at steps >= `epoch` (the TensorBoard
            # step is `key`'s value) are hidden, so the re-run steps show once, not twice. Also when
            # metrics.jsonl is gone (removed by hand): the event files still hold those steps.
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=epoch)

    def _truncate_lines(self, epoch: int, key: str) -> None:
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
        self._rerun_last = max((row[key] for _, row in rows if isinstance(row.get(key), (int, float))
                                and row[key] >= epoch), default=-1)
        self.path.write_text("".join(l + "\n" for l in keep))

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
        if self.wandb is not None and step >= self.wandb_from:
            self.wandb.log(scalars, step=step)

    def save_image(self, name: str, image: Image.Image | list[Image.Image], epoch: int) -> Path | None:
        """An image (a PNG), or a video's frames (an animated WebP a browser plays; TensorBoard gets the
        first frame, W&B a GIF of them) under images/."""
        if not self.enabled:
            return None
        video = isinstance(image, (list, tuple))
        path = self.run_dir / "images" / f"{name}_epoch{epoch:04d}.{'webp' if video else 'png'}"
        with writing(path, self.run_dir):
            if video:
                from paco_ds.images import save_animation

                save_animation(image, path)
            else:
                image.save(path)
        still = image[0] if video else image
        if self.tb is not None:
            import numpy as np

            self.tb.add_image(name, np.asarray(still.convert("RGB")), epoch, dataformats="HWC")
        if self.wandb is not None and epoch >= self.wandb_from:
            import wandb

            if video:  # W&B plays GIF, not WebP
                gif = path.with_suffix(".gif")
                with writing(gif, self.run_dir):
                    image[0].save(gif, save_all=True, append_images=list(image[1:]), duration=125, loop=0)
                item = wandb.Video(str(gif), format="gif")
            else:
                item = wandb.Image(image)
            self.wandb.log({f"images/{name}": item}, step=epoch)  # W&B's "images" section
        return path

    def close(self, error: BaseException | None = None) -> None:
        """Close the writers; `error` is what ended the run (None: it finished). The W&B run is
        finished with the process's exit status (a preempted run marked as such, to be resumed) and
        W&B's service process (wandb-core) is stopped here: the entry points end without interpreter
        teardown (paco_ds/errors.py), where W&B would otherwise stop it."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            import wandb

            from paco_ds.runtime.stopping import PREEMPTED_EXIT

            run, self.wandb = self.wandb, None
            code = exit_code_of(error)
            services = processes.descendants(WANDB_SERVICES)
            try:
                if code == PREEMPTED_EXIT:
                    run.mark_preempting()
                run.finish(exit_code=code)
            except Exception as err:  # noqa: BLE001 - W&B's own failure must not hide how the run ended
                log.warning("W&B could not finish run %s: %s", run.id, err)
            finally:
                wandb.teardown(exit_code=code)
                # wandb-core has ended; its system monitor ends on seeing that, a moment later
                left = processes.stop_processes(services, timeout=10.0)
                if left:
                    log.warning("W&B's processes %s still ran 10 s after the run finished; killed them", left)
