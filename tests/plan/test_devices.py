import pytest

from lightning_pipe.plan.devices import DEVICES, parse_devices


def test_count_x_name_reads_a_gpu_from_the_table_and_sizes_stay_sizes():
    spec, count = parse_devices("8xA100-40GB")
    assert (spec.name, count) == ("A100-40GB", 8)
    assert parse_devices(" 4 x h100-80gb ") == (DEVICES["H100-80GB"], 4)  # as people type it
    assert parse_devices("4x16GiB") is None and parse_devices("16GiB,8GiB") is None
    with pytest.raises(ValueError) as error:
        parse_devices("8xA100")
    assert "unknown device 'A100' in '8xA100'" in str(error.value)
    assert all(name in str(error.value) for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB"))


def test_the_table_holds_the_datasheet_figures():
    a100 = DEVICES["A100-40GB"]
    assert a100.memory == 40 * 2**30
    assert dict(a100.flops) == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert (a100.memory_bandwidth, a100.host_bandwidth, a100.link_bandwidth) == (1555e9, 32e9, 300e9)
    assert DEVICES["A100-80GB"].memory_bandwidth == 2039e9 and DEVICES["H100-80GB"].flops["bf16"] == 989.5e12
    # V100 has no TF32 or BF16 tensor cores: such math runs at its FP32 rate
    v100 = DEVICES["V100-32GB"]
    assert v100.peak_flops("tf32") == v100.peak_flops("bf16") == 15.7e12 and v100.peak_flops("fp16") == 125e12


def test_roofline_takes_the_longer_of_compute_and_memory():
    a100 = DEVICES["A100-40GB"]
    assert a100.roofline_ms(19.5e12, 1.0) == pytest.approx(1e3)  # a second of FP32 FLOPs, no bytes to speak of
    assert a100.roofline_ms(19.5e12, 1.0, "bf16") == pytest.approx(62.5)
    assert a100.roofline_ms(1.0, 1555e9) == pytest.approx(1e3)  # a second of bytes, no FLOPs to speak of
