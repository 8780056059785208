"""The examples run: each one's ``main`` on a tiny configuration."""

import pytest


@pytest.mark.slow
def test_hugging_face_gpt2_example_trains_over_four_stages_and_prints_the_split(capsys):
    pytest.importorskip("transformers")
    from examples.hf_gpt2 import main

    loss = main(["--layers", "1", "--dim", "32", "--context", "16", "--steps", "2", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert "final train_loss: " in out and loss > 0
    split = [line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert [line.split()[1] for line in split[-4:]] == ["cpu"] * 4  # the split: four CPU stages
