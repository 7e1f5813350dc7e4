"""Response lengths as a workload gives them: a fixed maximum, a mean under it, or a histogram."""

import pytest

from hfplan.errors import HfplanError
from hfplan.spec import BUILTIN_WORKLOADS, workload_from_dict

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
