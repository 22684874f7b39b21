"""train_eagle3(data_parallel_size=2) on 2 virtual CPU devices computes what 1 device computes: batch rows
split over a ("data",) mesh, head and target replicated, gradients all-reduced by XLA."""

import numpy as np
import pytest

from jspec.train.target import data_mesh
from tests.virtual_devices import run_on_virtual_devices

# slow: EAGLE-3 training data parallel over 2 devices = one device's loss; default tier: the one-device training tests
pytestmark = pytest.mark.slow

# f32: the 2-device program sums each half of the batch first and then all-reduces the halves, another order
# of the same additions as 1 device's; a few optimizer steps keep that rounding (~1e-7 relative) far below this.
RTOL = 1e-4


def test_data_parallel_steps_reproduce_one_device(tiny_trained_target, tmp_path):
    target_hf, _, corpus = tiny_trained_target
    result = run_on_virtual_devices("tests.jspec.train.data_parallel_worker", 2, target_hf, corpus, str(tmp_path),
                                    timeout=300)
    one, two = result["1"], result["2"]
    assert len(one["losses"]) == 4
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=RTOL)
    np.testing.assert_allclose(two["heldout"], one["heldout"], rtol=RTOL)
    np.testing.assert_allclose(two["accuracy"], one["accuracy"], atol=1e-6)
    assert one["losses"][-1] < one["losses"][0]  # the steps did train


def test_data_mesh_refuses_what_it_cannot_split():
    assert data_mesh(1, 8) is None
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        data_mesh(2, 8)  # this process sees one CPU device
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        data_mesh(0, 8)


def test_train_drafter_flags_and_defaults():
    from jspec.train.commands import train_drafter_parser

    base = ["--kind", "eagle3", "--target", "t", "--out", "o", "--work-dir", "w"]
    args = train_drafter_parser().parse_args(base)
    assert (args.unroll, args.decay, args.generated_fraction, args.data_parallel_size) == (7, 0.8, 1.0, 1)
    args = train_drafter_parser().parse_args(base + ["--data-parallel-size", "2", "--generated-fraction", "0.5"])
    assert (args.data_parallel_size, args.generated_fraction) == (2, 0.5)
