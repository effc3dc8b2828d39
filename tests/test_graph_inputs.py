"""The CUDA graphs' static inputs (gpu_worker/graph_capture.py GraphInputs): one upload per step, of every
field but the block table whole and of the table the corner the step reads. The class runs on the CPU too
(no pinned memory there), which is where this checks what lands in the device buffer."""

import numpy as np
import pytest
import torch

from gpu_worker.graph_capture import GraphInputs

SHAPES = {"input_ids": (8,), "context_lens": (8,), "block_tables": (8, 32)}


def filled(inputs: GraphInputs, seed: int) -> dict[str, np.ndarray]:
    host = inputs.fill()
    rng = np.random.default_rng(seed)
    for field in host.values():
        field[...] = rng.integers(0, 1000, size=field.shape)
    return host


def test_a_whole_upload_copies_every_field():
    inputs = GraphInputs(SHAPES, torch.device("cpu"))
    host = filled(inputs, 0)
    inputs.upload()
    for name, field in host.items():
        assert np.array_equal(inputs.device[name].numpy(), field)


@pytest.mark.parametrize(("rows", "columns"), [(3, 5), (8, 1), (5, 32), (8, 32)])
def test_a_step_uploads_its_corner_of_the_table_and_every_other_field(rows, columns):
    inputs = GraphInputs(SHAPES, torch.device("cpu"))
    filled(inputs, 1)
    inputs.upload()
    before = inputs.device["block_tables"].clone().numpy()
    host = filled(inputs, 2)
    inputs.upload(table_rows=rows, table_columns=columns)
    assert np.array_equal(inputs.device["input_ids"].numpy(), host["input_ids"])
    assert np.array_equal(inputs.device["context_lens"].numpy(), host["context_lens"])
    table = inputs.device["block_tables"].numpy()
    assert np.array_equal(table[:rows, :columns], host["block_tables"][:rows, :columns])
    expected_rest = before.copy()
    expected_rest[:rows, :columns] = table[:rows, :columns]
    assert np.array_equal(table, expected_rest)  # the entries no step reads keep older values


def test_the_block_table_must_be_the_last_field():
    with pytest.raises(ValueError, match="last field"):
        GraphInputs({"block_tables": (2, 4), "input_ids": (2,)}, torch.device("cpu"))
