"""The metrics loggers (jsonl, csv, tensorboard), a resumed run continuing each, and the refusal of a logger whose
package is missing; samples.jsonl and how samples are taken."""

from __future__ import annotations

import csv
import importlib.util
import json

import numpy as np
import pytest

from hfplan.errors import HfplanError
from hfplan.executor.loggers import (
    CSV_FILE,
    METRICS_FILE,
    TENSORBOARD_FOLDER,
    check_available,
    open_loggers,
    parse_names,
)
from hfplan.executor.samples import SAMPLES_FILE, Sample, SamplesFile, take_samples


def rows(count: int, start: int = 0, extra: dict | None = None) -> list[dict]:
    return [{"iteration": i, "reward": 0.1 * i, "actor/policy_loss": -0.5 * i, **(extra or {})}
            for i in range(start, start + count)]


def read_csv(path) -> tuple[list[str], list[dict]]:
    with path.open(newline="") as stream:
        reader = csv.DictReader(stream)
        return list(reader.fieldnames or []), list(reader)


def test_names_are_a_comma_list_of_known_loggers():
    assert parse_names("jsonl, csv,tensorboard,csv") == ("jsonl", "csv", "tensorboard")
    assert parse_names(["wandb"]) == ("wandb",)
    with pytest.raises(HfplanError, match="--logger mlflow: unknown logger; known: jsonl, csv, tensorboard, wandb"):
        parse_names("jsonl,mlflow")
    with pytest.raises(HfplanError, match="at least one"):
        parse_names(" , ")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_its_package_is_refused_naming_the_extra():
    with pytest.raises(HfplanError, match=r"--logger wandb needs the wandb package, not installed: pip install "
                                          r"'\.\[wandb\]'"):
        check_available(("jsonl", "wandb"))
    check_available(("jsonl", "csv"))


def test_jsonl_and_csv_hold_every_row(tmp_path):
    with open_loggers(("jsonl", "csv"), tmp_path, [], 0) as loggers:
        for row in rows(3):
            loggers.log(row)
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines == rows(3)
    header, table = read_csv(tmp_path / CSV_FILE)
    assert header == ["iteration", "reward", "actor/policy_loss"]
    assert [{k: float(v) for k, v in r.items()} for r in table] == rows(3)


def test_a_metric_that_appears_later_widens_the_csv_header(tmp_path):
    with open_loggers(("csv",), tmp_path, [], 0) as loggers:
        loggers.log(rows(1)[0])
        loggers.log({"lagrange": 1.5, **rows(1, start=1)[0]})
        loggers.log(rows(1, start=2)[0])  # lacks lagrange
    header, table = read_csv(tmp_path / CSV_FILE)
    assert header == ["iteration", "reward", "actor/policy_loss", "lagrange"]
    assert [r["lagrange"] for r in table] == ["", "1.5", ""]
    assert [r["iteration"] for r in table] == ["0", "1", "2"]
    assert not list(tmp_path.glob(".*.tmp"))  # the rewrite went through a temporary file and left none


def test_a_resumed_run_rewrites_jsonl_and_csv_from_its_checkpoint_and_continues(tmp_path):
    with open_loggers(("jsonl", "csv"), tmp_path, [], 0) as loggers:
        for row in rows(5):  # the first run logged 5 iterations, its checkpoint holds 3
            loggers.log(row)
    with open_loggers(("jsonl", "csv"), tmp_path, rows(3), 3) as loggers:
        for row in rows(2, start=3, extra={"kl": 0.01}):
            loggers.log(row)
    expected = rows(3) + rows(2, start=3, extra={"kl": 0.01})
    assert [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()] == expected
    header, table = read_csv(tmp_path / CSV_FILE)
    assert header[-1] == "kl"
    assert [int(r["iteration"]) for r in table] == [0, 1, 2, 3, 4]
    assert [r["kl"] for r in table] == ["", "", "", "0.01", "0.01"]


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard itself reads from the folder's event files: (step, value) per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_by_tensorboard_with_step_iteration(tmp_path):
    pytest.importorskip("tensorboard")
    with open_loggers(("tensorboard",), tmp_path, [], 0) as loggers:
        for row in rows(3):
            loggers.log(row)
    read = scalars(tmp_path / TENSORBOARD_FOLDER)
    assert set(read) == {"reward", "actor/policy_loss"}  # iteration is the step, not a scalar
    assert [step for step, _ in read["reward"]] == [0, 1, 2]
    assert [value for _, value in read["actor/policy_loss"]] == pytest.approx([0.0, -0.5, -1.0])


def test_a_resumed_run_supersedes_tensorboards_steps_after_its_checkpoint(tmp_path):
    """The first run logged iterations 0-4 and was killed after its checkpoint of 3 iterations; the resumed run
    logs 3 and 4 again, with other values: TensorBoard shows each step once, the resumed run's from step 3."""
    pytest.importorskip("tensorboard")
    with open_loggers(("tensorboard",), tmp_path, [], 0) as loggers:
        for row in rows(5):
            loggers.log(row)
    with open_loggers(("tensorboard",), tmp_path, rows(3), 3) as loggers:
        for row in rows(2, start=3):
            loggers.log({**row, "reward": 9.0})
    assert len(list((tmp_path / TENSORBOARD_FOLDER).iterdir())) == 2  # one event file per run
    read = scalars(tmp_path / TENSORBOARD_FOLDER)
    assert read["reward"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, 9.0), (4, 9.0)]


def test_samples_are_the_first_k_rows_decoded_with_the_runs_codec_and_their_scores():
    """A reward model's run: the K rows' token ids decoded with the actor's tokenizer (the real codec of `tiny`)."""
    pytest.importorskip("tokenizers")  # the execute extra's
    from hfplan.executor.codec import build_codec

    codec = build_codec("tiny")
    prompts = codec.encode(["the cat", "the cat", "a sun"], 8)
    responses = np.full((3, 6), codec.pad_id, dtype=np.int64)
    mask = np.zeros((3, 6), dtype=np.float32)
    for row, text in enumerate(["aei", "xy", "zzzz"]):
        ids = [i for i in codec.encode_batch([text])[0] if i >= 4]  # its bytes, without <bos>
        responses[row, :len(ids)], mask[row, :len(ids)] = ids, 1
    fields = {"prompts": prompts, "responses": responses, "response_mask": mask,
              "rewards": np.array([0.5, 0.25, 1.0], dtype=np.float32), "costs": np.array([1.0, 2.0, 3.0])}
    got = take_samples(4, 2, fields, None, codec.decode, codec.decode_responses)
    assert got == [Sample(4, 0, "the cat", "aei", 0.5, 1.0), Sample(4, 1, "the cat", "xy", 0.25, 2.0)]
    assert got[1].as_json() == {"iteration": 4, "row": 1, "prompt": "the cat", "response": "xy", "reward": 0.25,
                                "cost": 2.0}


def test_samples_take_a_controller_rewards_texts_without_decoding_again():
    fields = {"prompts": np.zeros((3, 2)), "responses": np.zeros((3, 2)), "response_mask": np.ones((3, 2)),
              "rewards": np.array([0.5, 0.25, 1.0])}

    def never(*_):
        raise AssertionError("decoded again")

    texts = (["a", "b", "c"], ["x", "y", "z"])
    assert take_samples(4, 5, fields, texts, never, never) == [Sample(4, row, p, r, score) for row, (p, r, score)
                                                                in enumerate(zip(*texts, [0.5, 0.25, 1.0],
                                                                                 strict=True))]
    assert take_samples(4, 0, {}, None, never, never) == []


def test_samples_file_keeps_a_resumed_runs_earlier_iterations(tmp_path):
    first = SamplesFile(tmp_path, 0)
    for iteration in range(4):
        first.write([Sample(iteration, row, f"p{row}", f"r{row}", 0.5) for row in range(2)])
    with (tmp_path / SAMPLES_FILE).open("a") as sink:
        sink.write('{"iteration": 4, "row"')  # cut short by a killed run
    resumed = SamplesFile(tmp_path, 2)
    resumed.write([Sample(2, 0, "q", "s", None)])
    got = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [(r["iteration"], r["row"]) for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert got[0] == {"iteration": 0, "row": 0, "prompt": "p0", "response": "r0", "reward": 0.5}
    SamplesFile(tmp_path, 0)  # a fresh run starts it empty
    assert (tmp_path / SAMPLES_FILE).read_text() == ""
