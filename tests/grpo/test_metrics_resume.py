"""metrics.jsonl and TensorBoard on resume: a torn last line (a kill mid-write) is dropped with a warning,
and the re-run epochs show once in TensorBoard (purge_step)."""
import json
import logging

import pytest

from paco_ds.errors import DataError
from paco_ds.runtime.metrics import MetricsLogger

pytestmark = pytest.mark.fast


def _logger(tmp_path):
    return MetricsLogger(tmp_path, enabled=True, tensorboard=False)


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    rows = [{"epoch": 0, "loss": 1.0}, {"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 3, "lo')
    with caplog.at_level(logging.WARNING):
        _logger(tmp_path).truncate_after(2)
    assert [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == rows[:2]
    assert "torn last line" in caplog.text and "metrics.jsonl:4" in caplog.text


def test_a_bad_line_before_the_last_is_an_error_naming_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n{"epo\n{"epoch": 1}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl:2: not a JSON object"):
        _logger(tmp_path).truncate_after(1)


@pytest.mark.parametrize("jsonl_kept", [True, False])
def test_after_a_resume_tensorboard_has_one_point_per_epoch(tmp_path, jsonl_kept):
    """The epochs a resume runs again replace their first values in TensorBoard, read back from the
    event files with TensorBoard's own reader; also when metrics.jsonl was removed before the resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    for epoch in range(4):
        first.log({"epoch": epoch, "loss": float(epoch)}, step=epoch)
    first.close()
    if not jsonl_kept:
        (tmp_path / "metrics.jsonl").unlink()
    resumed = MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    resumed.truncate_after(2)
    for epoch in (2, 3, 4):
        resumed.log({"epoch": epoch, "loss": 10.0 + epoch}, step=epoch)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"), purge_orphaned_data=True)
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("loss")]
    assert points == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
