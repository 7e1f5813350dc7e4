"""Hardware profiles: the shipped YAML files, round trips, and errors that name the field."""

import pytest
import yaml

from hfplan.errors import HfplanError
from hfplan.profiles.hardware import GIB, HardwareProfile, load_hardware, shipped_names

SHIPPED = shipped_names()


def test_expected_profiles_are_shipped():
    assert {"a100-80g", "h100-80g", "h200-141g", "cpu"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_profile_loads(name):
    profile = load_hardware(name)
    assert isinstance(profile, HardwareProfile)
    assert profile.name == name  # the file name and the name inside agree
    assert profile.gpus_per_node > 0
    assert 0 < profile.memory.reserved_gib < profile.memory.capacity_gib


def test_derived_rates_by_hand():
    a100 = load_hardware("a100-80g")
    assert a100.peak_flops == pytest.approx(312e12)
    assert a100.memory.usable_bytes == pytest.approx((80 - 6) * 1024**3)
    assert a100.links.intra_node.effective_bytes_per_s == pytest.approx(300e9 * 0.77)
    assert a100.links.inter_node.effective_bytes_per_s == pytest.approx(25e9 * 0.9)
    assert GIB == 1024**3


def test_cpu_profile_uses_gloo_and_the_gpus_use_nccl():
    assert load_hardware("cpu").backend == "gloo"
    for name in ("a100-80g", "h100-80g", "h200-141g"):
        assert load_hardware(name).backend == "nccl"


@pytest.mark.parametrize("name", SHIPPED)
def test_yaml_round_trip(tmp_path, name):
    profile = load_hardware(name)
    path = tmp_path / f"{name}-copy.yaml"
    path.write_text(profile.to_yaml())
    again = load_hardware(str(path))
    assert again == profile
    assert again.to_yaml() == profile.to_yaml()


def test_round_trip_of_a_measured_profile(tmp_path, toy_hw):
    measured = toy_hw.model_copy(update={"measured": True, "date": "2025-01-31", "backend": "gloo"})
    path = tmp_path / "measured.yml"
    path.write_text(measured.to_yaml())
    assert load_hardware(str(path)) == measured


def test_unknown_name_lists_known_names():
    with pytest.raises(HfplanError, match="unknown hardware 'tpu-v9'") as caught:
        load_hardware("tpu-v9")
    for name in SHIPPED:
        assert name in str(caught.value)


def test_missing_profile_file(tmp_path):
    with pytest.raises(HfplanError, match="not found"):
        load_hardware(str(tmp_path / "nope.yaml"))


def _shipped_data(name: str = "a100-80g") -> dict:
    return yaml.safe_load(load_hardware(name).to_yaml())


def _load_data(tmp_path, data) -> HardwareProfile:
    path = tmp_path / "profile.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return load_hardware(str(path))


def test_malformed_yaml(tmp_path):
    with pytest.raises(HfplanError, match="not valid YAML"):
        _load_data(tmp_path, "name: a100\ncompute: [unclosed\n")


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(HfplanError, match="mapping"):
        _load_data(tmp_path, "- a\n- b\n")


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (("compute", "peak_tflops"), "compute.peak_tflops"),
        (("memory", "bandwidth_gbytes_per_s"), "memory.bandwidth_gbytes_per_s"),
        (("links", "inter_node"), "links.inter_node"),
        (("gpus_per_node",), "gpus_per_node"),
    ],
)
def test_missing_field_is_named(tmp_path, path, field):
    data = _shipped_data()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    with pytest.raises(HfplanError, match="Field required") as caught:
        _load_data(tmp_path, data)
    assert f"field {field}" in str(caught.value)


@pytest.mark.parametrize(
    ("section", "field"),
    [(None, "colour"), ("compute", "compute.turbo"), ("links", "links.nvlink5")],
)
def test_extra_field_is_named(tmp_path, section, field):
    data = _shipped_data()
    key = field.rsplit(".", 1)[-1]
    (data if section is None else data[section])[key] = 1
    with pytest.raises(HfplanError, match="Extra inputs") as caught:
        _load_data(tmp_path, data)
    assert f"field {field}" in str(caught.value)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("compute", "matmul_efficiency", 1.5),
        ("compute", "peak_tflops", 0),
        ("memory", "capacity_gib", -80),
        (None, "backend", "mpi"),
        (None, "gpus_per_node", 0),
    ],
)
def test_out_of_range_value_is_named(tmp_path, section, key, value):
    data = _shipped_data()
    (data if section is None else data[section])[key] = value
    with pytest.raises(HfplanError) as caught:
        _load_data(tmp_path, data)
    where = key if section is None else f"{section}.{key}"
    assert f"field {where}" in str(caught.value)


def test_bandwidths_are_named_in_gigabytes_per_second():
    dumped = load_hardware("a100-80g").model_dump()
    assert dumped["memory"]["bandwidth_gbytes_per_s"] == 2039
    # 200 Gb/s between nodes, as the profile's description says, is 25 GB/s
    assert dumped["links"]["inter_node"]["bandwidth_gbytes_per_s"] == 25
    assert "bandwidth_gbps" not in load_hardware("a100-80g").to_yaml()


def test_profiles_with_the_old_bandwidth_name_still_load(tmp_path):
    """Profiles written before the rename say `bandwidth_gbps`; they read the same, and write the new name."""
    text = yaml.safe_dump(_shipped_data()).replace("bandwidth_gbytes_per_s", "bandwidth_gbps")
    assert text.count("bandwidth_gbps") == 4
    old = _load_data(tmp_path, text)
    assert old == load_hardware("a100-80g")
    assert "bandwidth_gbps" not in old.to_yaml()


def test_a_bad_protocol_is_named(tmp_path):
    """A protocol's share of the bus bandwidth is at most all of it: one line naming the field."""
    data = _shipped_data()
    data["links"]["intra_node"]["protocols"] = [{"name": "LL", "base_us": 6.6, "hop_us": 0.6,
                                                  "bandwidth_fraction": 1.5}]
    with pytest.raises(HfplanError) as caught:
        _load_data(tmp_path, data)
    assert "field links.intra_node.protocols.0.bandwidth_fraction" in str(caught.value)
