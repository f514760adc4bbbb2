"""Profiles people can write: ``base:`` + overrides, ``--set FIELD=VALUE``, link efficiency, objects as names."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from moelab.errors import MoelabError
from moelab.timing import FIELDS, get_profile, load_profile
from moelab.timing.profile import (
    OPTIONAL_FIELDS,
    PROFILES_DIR,
    apply_settings,
    parse_profile,
    parse_setting,
)


def _write(tmp_path, data, name="box.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def test_a_base_profile_plus_overrides_keeps_the_inherited_provenance(tmp_path):
    path = _write(tmp_path, {"name": "my-h100", "base": "h100-pcie5-ddr5",
                             "host_memory_gb": {"value": 512, "stated": "free -g on my box"}})
    hw, base = load_profile(path), get_profile("h100-pcie5-ddr5")
    assert hw.name == "my-h100" and hw.host_memory_gb == 512.0
    assert hw.provenance["host_memory_gb"] == "stated: free -g on my box"
    for f in FIELDS:
        if f != "host_memory_gb":
            assert getattr(hw, f) == getattr(base, f) and hw.provenance[f] == base.provenance[f], f
    assert hw.description.startswith(base.description) and "host_memory_gb" in hw.description


def test_a_base_may_be_a_file_next_to_this_one_and_a_cycle_is_refused(tmp_path):
    _write(tmp_path, {"name": "a", "base": "pcie4-x16", "cpu_cores": {"value": 4, "assumed": "x"}}, "a.yaml")
    hw = load_profile(_write(tmp_path, {"name": "b", "base": "a.yaml", "copy_engines": {"value": 2, "assumed": "y"}},
                             "b.yaml"))
    assert (hw.cpu_cores, hw.copy_engines, hw.link_bandwidth_gbs) == (4, 2, 25.0)
    _write(tmp_path, {"name": "c", "base": "d.yaml"}, "c.yaml")
    _write(tmp_path, {"name": "d", "base": "c.yaml"}, "d.yaml")
    with pytest.raises(MoelabError, match="leads back to itself"):
        load_profile(tmp_path / "c.yaml")


@pytest.mark.parametrize("base, match", [("h100-pcie5", "unknown hardware profile 'h100-pcie5'.*h100-pcie5-ddr5"),
                                         ("", "`base` must name a profile"),
                                         ("missing.yaml", "does not exist")])
def test_a_bad_base_is_refused_with_the_fix(tmp_path, base, match):
    with pytest.raises(MoelabError, match=match):
        load_profile(_write(tmp_path, {"name": "x", "base": base}))


def test_optional_fields_left_out_are_marked_assumed():
    data = yaml.safe_load((PROFILES_DIR / "pcie4-x16.yaml").read_text())
    for f in OPTIONAL_FIELDS:
        data.pop(f)
    hw = parse_profile(data)
    assert hw.link_efficiency == 1.0 and hw.gpu_memory_gb is None and hw.host_memory_gb is None
    assert all(hw.provenance[f].startswith("assumed: not given in the file") for f in OPTIONAL_FIELDS)


def test_the_link_applies_its_efficiency_so_every_consumer_sees_the_effective_bandwidth():
    hw = get_profile("promoe-4090")  # ProMoE: 23.9 GB/s measured on the nominal 32
    assert hw.link_bandwidth_gbs == 32.0 and hw.link_efficiency == pytest.approx(0.747)
    assert hw.link.bandwidth_gbs == pytest.approx(23.904) == hw.effective_link_bandwidth_gbs
    assert hw.transfer_time_us(23.904e6) == pytest.approx(hw.link_latency_us + 1000.0)
    with pytest.raises(MoelabError, match=r"link_efficiency must be in \(0, 1\], got 1.5"):
        hw.with_changes(link_efficiency=1.5)


@pytest.mark.parametrize("text, expected", [("link_efficiency=0.75", ("link_efficiency", 0.75)),
                                            ("cpu_cores = 8", ("cpu_cores", 8)),
                                            ("gpu_memory_gb=80", ("gpu_memory_gb", 80.0)),
                                            ("device_shares_host_memory=true", ("device_shares_host_memory", True))])
def test_set_parses_values_by_the_fields_type(text, expected):
    key, value = parse_setting(text)
    assert (key, value) == expected and type(value) is type(expected[1])


@pytest.mark.parametrize("text, match", [
    ("link_eficiency=0.7", r"'link_eficiency' is not a profile field; Did you mean 'link_efficiency'"),
    ("cpu_cores=2.5", r"cpu_cores='2.5': expected a whole number ≥ 1"),
    ("link_bandwidth_gbs=fast", r"expected a number > 0"),
    ("device_shares_host_memory=maybe", "expected true or false"),
    ("link_efficiency", "expected FIELD=VALUE"),
])
def test_set_refuses_unknown_fields_and_wrong_types(text, match):
    with pytest.raises(MoelabError, match=match):
        parse_setting(text)


def test_set_checks_constraints_and_marks_provenance():
    hw = apply_settings(get_profile("h100-pcie5-ddr5"), ["link_efficiency=0.5", "gpu_memory_gb=94"])
    assert hw.link.bandwidth_gbs == 25.0 and hw.gpu_memory_gb == 94.0
    assert hw.provenance["gpu_memory_gb"].startswith("assumed: --set on the command line")
    assert apply_settings(hw, None) is hw
    with pytest.raises(MoelabError, match=r"--set on profile 'h100-pcie5-ddr5'.*link_efficiency must be in "
                                           r"\(0, 1\], got 0.0"):
        apply_settings(hw, ["link_efficiency=0"])


def test_a_changed_profile_is_usable_where_a_name_is():
    hw = get_profile("h100-pcie5-ddr5").with_changes(cpu_cores=8)
    assert get_profile(hw) is hw
    assert get_profile(dataclasses.replace(hw, numa_nodes=1)).numa_nodes == 1
    with pytest.raises(MoelabError, match="no field 'cpu_core'.*Did you mean 'cpu_cores'"):
        hw.with_changes(cpu_core=8)


def test_every_shipped_profile_round_trips_through_a_file(tmp_path):
    from moelab.timing import available_profiles
    from moelab.timing.profile import save_profile

    for name in available_profiles():
        hw = get_profile(name)
        back = load_profile(save_profile(hw, tmp_path / f"{name}.yaml"))
        assert back == hw and dict(back.provenance) == dict(hw.provenance), name
    changed = apply_settings(get_profile("pcie4-x16"), ["gpu_memory_gb=48"])
    back = load_profile(save_profile(changed, tmp_path / "changed.yaml"))
    assert back.gpu_memory_gb == 48.0 and back.provenance["gpu_memory_gb"].startswith("assumed: --set")
