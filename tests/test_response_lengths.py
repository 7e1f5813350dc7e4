"""Response lengths as a workload gives them: a fixed maximum, a mean under it, or a histogram."""

import pytest

from hfplan.errors import HfplanError
from hfplan.spec import BUILTIN_WORKLOADS, ResponseLengths, workload_from_dict

BASE = BUILTIN_WORKLOADS["ppo-llama2-7b"] | {"response_len": 512}


def test_default_is_every_response_at_the_maximum():
    lengths = workload_from_dict(BASE, "t").response_lengths
    assert (lengths.max_len, lengths.mean, lengths.points) == (512, 512.0, ((512, 1.0),))


def test_mean_under_the_maximum():
    lengths = workload_from_dict(BASE | {"response_len_mean": 200}, "t").response_lengths
    assert (lengths.max_len, lengths.mean, lengths.points) == (512, 200.0, ())


def test_histogram_is_normalised_and_merged():
    bins = [{"length": 100, "weight": 2}, {"length": 400, "weight": 1}, {"length": 100, "weight": 1}]
    workload = workload_from_dict(BASE | {"response_len_histogram": bins}, "t")
    lengths = workload.response_lengths
    assert lengths.points == ((100, 0.75), (400, 0.25))
    assert lengths.mean == pytest.approx(175.0)
    assert workload.response_len == 512 and workload.seq_len == 1024 + 512  # the maximum still bounds memory


@pytest.mark.parametrize(("extra", "message"), [
    ({"response_len_mean": 600}, "response_len_mean 600 exceeds response_len 512"),
    ({"response_len_histogram": [{"length": 513, "weight": 1}]}, "length 513 > response_len 512"),
    ({"response_len_mean": 100, "response_len_histogram": [{"length": 100, "weight": 1}]}, "not both"),
    ({"response_len_histogram": [{"length": 10, "weight": 0}]}, "weight"),
    ({"response_len_histogram": []}, "response_len_histogram"),
])
def test_bad_lengths_are_named(extra, message):
    with pytest.raises(HfplanError, match=message):
        workload_from_dict(BASE | extra, "t")


def test_tokens_a_refilled_slot_holds_and_the_peak_of_a_batch_started_together():
    # Fixed 100: a slot holds 0..99 response tokens, 49.5 on average; all at 50 + 100 at the last step.
    fixed = ResponseLengths.fixed(100)
    assert fixed.held_by_slot == pytest.approx(49.5)
    assert fixed.peak_held(50) == pytest.approx(150)
    # Half 100, half 300: E[l^2] / E[l] = 50000 / 200 = 250 -> (250 - 1) / 2; peak max(1 x 100, 0.5 x 300) with
    # no prompt, max(1 x 200, 0.5 x 400) with a prompt of 100.
    two = ResponseLengths(300, 200.0, ((100, 0.5), (300, 0.5)))
    assert two.held_by_slot == pytest.approx(124.5)
    assert two.peak_held(0) == pytest.approx(150)
    assert two.peak_held(100) == pytest.approx(200)
    # Only a mean: the conservative choices (E[l^2] = mean x max; every sequence at its maximum).
    mean_only = ResponseLengths(300, 100.0)
    assert mean_only.held_by_slot == pytest.approx((300 - 1) / 2)
    assert mean_only.peak_held(10) == pytest.approx(310)
