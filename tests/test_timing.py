"""moelab.timing: the FIFO link model (hand-computed schedules), profile files and the registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from moelab.errors import MoelabError
from moelab.timing import (
    DEFAULT_PROFILE,
    FIELDS,
    PROFILES,
    Link,
    available_profiles,
    fifo_schedule,
    get_profile,
    load_profile,
    register_profile,
)
from moelab.timing.profile import PROFILES_DIR


# ---------------------------------------------------------------------- link
def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    link = Link(bandwidth_gbs=25.0, latency_us=10.0)
    assert link.transfer_us(1_000_000) == pytest.approx(50.0)  # 10 + 1e6 B / 25e3 B/µs
    assert link.transfer_us(0) == 10.0


def test_fifo_waits_for_the_link_and_for_the_request():
    link = Link(bandwidth_gbs=1.0, latency_us=5.0)  # 1000 B/µs
    # three 1000-byte transfers (6 µs each): two requested at 0 queue up; the third is
    # requested at 20 when the link has long been free; a fourth at 21 waits for the third.
    start, end = fifo_schedule(link, [0.0, 0.0, 20.0, 21.0], 1000)
    assert start.tolist() == [0.0, 6.0, 20.0, 26.0]
    assert end.tolist() == [6.0, 12.0, 26.0, 32.0]


def test_fifo_serves_in_queue_order_not_ready_order_and_sizes_per_transfer():
    link = Link(bandwidth_gbs=2.0, latency_us=0.0)  # 2000 B/µs
    start, end = fifo_schedule(link, [10.0, 0.0], [4000, 2000])
    # the first queued transfer is ready at 10 (2 µs); the second (ready at 0) waits behind it
    assert start.tolist() == [10.0, 12.0] and end.tolist() == [12.0, 13.0]
    start, end = fifo_schedule(link, [0.0], 2000, free_at_us=7.5)  # link busy until 7.5
    assert start.tolist() == [7.5] and end.tolist() == [8.5]


def test_link_queue_is_the_same_schedule_one_request_at_a_time():
    link = Link(bandwidth_gbs=3.0, latency_us=1.5)
    ready = [0.0, 0.2, 5.0, 5.0, 40.0]
    s, e = fifo_schedule(link, ready, 12_345)
    q = link.queue()
    assert [q.request(r, 12_345) for r in ready] == list(zip(s.tolist(), e.tolist()))


def test_transfers_within_a_window():
    link = Link(bandwidth_gbs=1.0, latency_us=10.0)  # 1000 B: 11 µs each
    assert link.transfers_within(33.0, 1000) == 3  # ends at 11, 22, 33 (exactly on time counts)
    assert link.transfers_within(32.9, 1000) == 2
    assert link.transfers_within(5.0, 1000) == 0
    assert Link(25.0).transfers_within(500.0, 1_000_000) == 12  # 40 µs each, no latency


@pytest.mark.parametrize("bw, lat, match", [(0, 0, "bandwidth_gbs"), (-1, 0, "bandwidth_gbs"),
                                            (math.inf, 0, "bandwidth_gbs"), (1, -1, "latency_us"),
                                            ("25", 0, "bandwidth_gbs")])
def test_bad_links_are_refused(bw, lat, match):
    with pytest.raises(MoelabError, match=match):
        Link(bw, lat)


def test_profile_link_matches_its_fields():
    hw = get_profile("pcie4-x16")
    assert hw.link == Link(hw.link_bandwidth_gbs, hw.link_latency_us)
    assert hw.transfer_time_us(25e6) == pytest.approx(hw.link_latency_us + 1000.0)


# ---------------------------------------------------------------------- profile files
def test_every_shipped_profile_loads_and_marks_every_number():
    names = available_profiles()
    assert {"pcie3-x16", "pcie4-x16", "pcie5-x16", "nvlink-c2c", "ktransformers-a100", "osdi26-5090",
            "promoe-4090", "hybrimoe-a6000", "moegen-a5000"} <= set(names)
    assert DEFAULT_PROFILE in names
    for name in names:
        hw = get_profile(name)
        assert hw.name == name
        assert set(hw.provenance) == set(FIELDS)
        for f, note in hw.provenance.items():
            basis, _, why = note.partition(": ")
            assert basis in ("stated", "assumed") and why, (name, f, note)


def test_paper_profiles_carry_the_papers_numbers():
    assert get_profile("promoe-4090").link_bandwidth_gbs == 32.0
    assert get_profile("promoe-4090").provenance["link_bandwidth_gbs"].startswith("stated: ProMoE §7.1")
    kt = get_profile("ktransformers-a100")
    assert (kt.cpu_memory_bandwidth_gbs, kt.cpu_cores) == (220.0, 72)
    osdi = get_profile("osdi26-5090")
    assert osdi.decode_layer_time_us == 800.0 and osdi.cpu_memory_bandwidth_gbs == 1228.0
    assert get_profile("hybrimoe-a6000").cpu_cores == 10


def test_shipped_files_are_package_data():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["moelab"]
    assert "timing/profiles/*.yaml" in globs
    assert any(d.startswith("pyyaml") for d in cfg["project"]["dependencies"])
    assert sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")) == sorted(
        n for n in available_profiles() if (PROFILES_DIR / f"{n}.yaml").exists()
    )


def _good() -> dict:
    d = yaml.safe_load((PROFILES_DIR / "pcie4-x16.yaml").read_text())
    d["name"] = "my-box"
    return d


def _write(tmp_path, data, name="box.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, allow_unicode=True) if not isinstance(data, str) else data)
    return path


def test_a_user_profile_loads_from_a_path(tmp_path):
    data = _good()
    data["link_bandwidth_gbs"] = {"value": 7, "stated": "my measurement, nvbandwidth"}
    path = _write(tmp_path, data)
    hw = get_profile(str(path))
    assert hw.name == "my-box" and hw.link_bandwidth_gbs == 7.0 and isinstance(hw.link_bandwidth_gbs, float)
    assert hw.provenance["link_bandwidth_gbs"] == "stated: my measurement, nvbandwidth"
    assert get_profile(path) == hw
    with PROFILES.temporarily("my-box", hw):
        assert get_profile("my-box") is hw
    assert "my-box" not in available_profiles()


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.update(link_bandwith_gbs={"value": 1, "assumed": "x"}),
         r"box.yaml': unknown field 'link_bandwith_gbs'\. Did you mean 'link_bandwidth_gbs'"),
        (lambda d: d.pop("cpu_cores"), r"box.yaml': missing field 'cpu_cores'"),
        (lambda d: d.pop("description"), r"missing field 'description' \(a string\)"),
        (lambda d: d.update(cpu_cores={"value": 16.5, "assumed": "x"}),
         r"field 'cpu_cores': value must be an integer"),
        (lambda d: d.update(link_latency_us={"value": "10", "assumed": "x"}),
         r"field 'link_latency_us': value must be a number .*got '10'"),
        (lambda d: d.update(link_latency_us={"value": True, "assumed": "x"}), r"value must be a number"),
        (lambda d: d.update(link_latency_us=10.0), r"field 'link_latency_us' must be a mapping with `value`"),
        (lambda d: d.update(link_latency_us={"value": 10.0}), r"exactly one of `stated: SOURCE`.*got neither"),
        (lambda d: d.update(link_latency_us={"value": 10.0, "stated": "a", "assumed": "b"}),
         r"exactly one of .*\['stated', 'assumed'\]"),
        (lambda d: d.update(link_latency_us={"value": 10.0, "assumed": ""}), r"must name the source or the reason"),
        (lambda d: d.update(link_latency_us={"value": 10.0, "assumed": "x", "unit": "us"}),
         r"unknown key\(s\) \['unit'\]"),
        (lambda d: d.update(attention_fraction={"value": 1.5, "assumed": "x"}),
         r"box.yaml': HardwareProfile.attention_fraction must be in \[0, 1\], got 1.5"),
        (lambda d: d.update(name=3), r"field 'name' must be a non-empty string"),
    ],
)
def test_profile_file_errors_name_file_field_and_fix(tmp_path, change, match):
    data = _good()
    change(data)
    path = _write(tmp_path, data)
    with pytest.raises(MoelabError, match=match) as info:
        load_profile(path)
    assert "\n" not in str(info.value)


def test_profile_file_that_is_not_a_mapping_or_not_yaml(tmp_path):
    with pytest.raises(MoelabError, match="expected a mapping of fields"):
        load_profile(_write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(MoelabError, match="not valid YAML/JSON"):
        load_profile(_write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(MoelabError, match="does not exist"):
        get_profile(str(tmp_path / "missing.yaml"))


def test_registry_did_you_mean_and_collisions():
    with pytest.raises(MoelabError, match="Did you mean 'pcie4-x16'"):
        get_profile("pcie4-x61")
    hw = get_profile("pcie4-x16")
    mine = hw.with_changes(decode_layer_time_us=800.0)
    assert mine.provenance["decode_layer_time_us"].startswith("assumed: set by the caller")
    assert hw.provenance["decode_layer_time_us"] != mine.provenance["decode_layer_time_us"]
    with pytest.raises(MoelabError, match="already registered"):
        register_profile(mine)
    try:
        register_profile(mine, name="slow-box-for-test")
        assert get_profile("slow-box-for-test").decode_layer_time_us == 800.0
        with pytest.raises(MoelabError, match="must be an instance of HardwareProfile"):
            PROFILES.register("junk-for-test", {"name": "x"})
    finally:
        PROFILES.unregister("slow-box-for-test")


def test_prefetch_budget_from_a_profile_and_a_link_with_latency():
    from moelab.caches.simulation import PrefetchConfig

    hw = get_profile("pcie4-x16")  # 25 GB/s, 10 µs, 500 µs per layer
    cfg = PrefetchConfig.from_profile("pcie4-x16", num_layers=4)  # a 2000 µs step
    # 1 MB experts: 10 + 40 = 50 µs each -> 40 fit in 2000 µs (bandwidth × time alone: 50)
    assert cfg.experts_budget(1_000_000) == 40 == hw.link.transfers_within(2000.0, 1_000_000)
    with_lat = PrefetchConfig.from_link(gb_per_s=25, step_ms=2.0, latency_us=10.0)
    assert with_lat.experts_budget(1_000_000) == 40
    assert PrefetchConfig.from_link(gb_per_s=25, step_ms=2.0).experts_budget(1_000_000) == 50
    with pytest.raises(MoelabError, match="not budget and link"):
        PrefetchConfig(budget=2, link=hw.link, window_us=1.0).experts_budget(1)
    with pytest.raises(MoelabError, match="num_layers must be an integer"):
        PrefetchConfig.from_profile(num_layers=0)


def test_goodpred_schedule_is_the_fifo_link():
    """in_time_schedule equals a FIFO schedule computed here by hand for a static predictor."""
    from moelab.predictors.timing import in_time_schedule, transfer_model

    tm = transfer_model("pcie5-x16", 4_000_000, 0.0)  # 8 + 80 = 88 µs per expert; T = 400, start = -200
    got = in_time_schedule("static", 1, [3, 3], tm)
    ends = -200 + 88 * np.arange(1, 7)  # all six queued at -200: -112, -24, 64 | 152, 240, 328
    assert got.tolist() == [[e <= 0 for e in ends[:3]], [e <= 400 for e in ends[3:]]]


def test_cli_link_latency_needs_the_link(tmp_path, capsys):
    from moelab.cli import main

    argv = ["cache", "simulate", "--trace", str(tmp_path), "--policy", "lru", "--prefetch", "oracle"]
    assert main([*argv, "--link-latency-us", "5"]) == 2
    assert "add --link-gbps and --step-ms" in capsys.readouterr().err


# ---------------------------------------------------------------------- the simulator's fields
@pytest.mark.parametrize("field", ["link_bandwidth_gbs", "numa_node_bandwidth_gbs", "gpu_memory_bandwidth_gbs"])
@pytest.mark.parametrize("value", [0, -5.0])
def test_a_zero_or_negative_bandwidth_is_one_line_naming_field_and_fix(tmp_path, field, value):
    data = _good()
    data[field] = {"value": value, "assumed": "x"}
    with pytest.raises(MoelabError, match=rf"HardwareProfile\.{field} must be > 0, got {float(value)}; .*set it to") as info:
        load_profile(_write(tmp_path, data))
    assert "\n" not in str(info.value)


def test_simulator_fields_types_and_presets(tmp_path):
    data = _good()
    data["device_shares_host_memory"] = {"value": 1, "assumed": "x"}
    with pytest.raises(MoelabError, match="'device_shares_host_memory': value must be true or false"):
        load_profile(_write(tmp_path, data))
    data["device_shares_host_memory"] = {"value": True, "stated": "a CPU-only box"}
    data["copy_engines"] = {"value": 0, "assumed": "x"}
    with pytest.raises(MoelabError, match=r"copy_engines must be ≥ 1, got 0; set a value ≥ 1"):
        load_profile(_write(tmp_path, data))
    data["copy_engines"] = {"value": 2, "assumed": "x"}
    hw = load_profile(_write(tmp_path, data))
    assert hw.device_shares_host_memory is True and hw.copy_engines == 2
    assert {"h100-pcie5-ddr5", "rtx4090-desktop", "gh200"} <= set(available_profiles())
    kt = get_profile("ktransformers-a100")
    assert (kt.numa_nodes, kt.numa_node_bandwidth_gbs, kt.gpu_peak_tflops) == (2, 220.0, 312.0)
    assert kt.provenance["numa_node_bandwidth_gbs"].startswith("stated: KTransformers §6.1")
