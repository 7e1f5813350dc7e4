"""A few of each iteration's sampled responses as text (`hfplan execute --samples K`): OUT/samples.jsonl.

The samples of an iteration are its first K sequences of the sampled (not greedy) generation, in the batch's
order (the iteration's prompts in data order, each prompt's n samples together), with the score of each: the
`reward` (and Safe-RLHF's `cost`) as the reward role returned it, before the KL penalty. Texts a controller
reward decoded already are taken as they are; otherwise (a reward model) the K rows' token ids are decoded with
the run's tokenizer. With K = 0 nothing is decoded and the file is neither written nor touched. An evaluation
(--eval-data) adds the first K of its greedy responses to the held-out prompts after its iteration's rows, each
marked `"eval": true`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hfplan.files import write_atomically

SAMPLES_FILE = "samples.jsonl"
SCORES = (("rewards", "reward"), ("costs", "cost"))  # batch field -> the sample's key (as in the metrics)


@dataclass(frozen=True)
class Sample:
    iteration: int
    row: int  # the sequence's row in the iteration's batch
    prompt: str
    response: str
    reward: float | None = None
    cost: float | None = None
    eval: bool = False  # a greedy response to a held-out prompt (--eval-data); `row` is then the prompt's row there

    def as_json(self) -> dict:
        """The sample's keys; `eval` only on an evaluation's rows (`"eval": true`)."""
        return {key: value for key, value in asdict(self).items()
                if (value is not None or key == "reward") and (key != "eval" or value)}


def take_samples(iteration: int, count: int, fields: dict, texts: tuple[list[str], list[str]] | None,
                 decode_prompts: Callable[[np.ndarray], list[str]],
                 decode_responses: Callable[[np.ndarray, np.ndarray], list[str]]) -> list[Sample]:
    """The first `count` rows of an iteration's sampled sequences. `fields`: the sampled generation's outputs
    and the scores (`prompts`, `responses`, `response_mask`, `rewards`, `costs`); `texts`: the (prompts,
    responses) a controller reward decoded, if one did."""
    if count <= 0:
        return []
    rows = min(count, len(fields["responses"]))
    if texts is not None:
        prompts, responses = texts[0][:rows], texts[1][:rows]
    else:
        prompts = decode_prompts(fields["prompts"][:rows])
        responses = decode_responses(fields["responses"][:rows], fields["response_mask"][:rows])
    scores = {key: np.asarray(fields[name], dtype=np.float64).reshape(len(fields["responses"]), -1).sum(axis=1)
              for name, key in SCORES if name in fields}
    return [Sample(iteration, row, prompts[row], responses[row],
                   **{key: float(values[row]) for key, values in scores.items()}) for row in range(rows)]


class SamplesFile:
    """OUT/samples.jsonl: one JSON object per sample. A fresh run starts it empty; a resumed run keeps the rows
    of the iterations its checkpoint has done and drops those after (the resumed run samples them again)."""

    def __init__(self, out: Path, first_iteration: int) -> None:
        self.path = out / SAMPLES_FILE
        kept: list[str] = []
        if first_iteration > 0 and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    if int(json.loads(line)["iteration"]) < first_iteration:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a killed run
        write_atomically(self.path, "".join(kept))

    def write(self, samples: Sequence[Sample]) -> None:
        if samples:
            with self.path.open("a") as sink:
                sink.write("".join(json.dumps(s.as_json(), ensure_ascii=False) + "\n" for s in samples))
