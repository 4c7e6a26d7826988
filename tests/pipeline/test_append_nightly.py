"""The folder of train files the nightly demo reads (the nightly append itself, in-process: test_nightly_routes.py;
from a real server's schedule: test_nightly_real_server.py)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trak_core.errors import BadInputError
from trakflow_demo_data import folder_data


def test_load_folder_concatenates_sorted_files(tmp_path):
    a = (torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 2]))
    b = (torch.arange(6.0, 10.0).reshape(2, 2), torch.tensor([3, 4]))
    np.savez(tmp_path / "part_001.npz", b[0].numpy(), b[1].numpy())
    folder_data.save_part(tmp_path, a, 0)
    (tmp_path / "notes.txt").write_text("not data")
    x, y = folder_data.load_folder(tmp_path)
    torch.testing.assert_close(x, torch.cat([a[0], b[0]]))
    torch.testing.assert_close(y, torch.cat([a[1], b[1]]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="no .pt or .npz files"):
        folder_data.load_folder(tmp_path / "empty")
