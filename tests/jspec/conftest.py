"""Fixtures shared by tests/jspec: one tiny target trained for a few steps, for the training-script tests."""

import pytest


@pytest.fixture(scope="session")
def tiny_trained_target(tmp_path_factory):
    """(HF dir, training report, corpus root) of a tiny Llama trained a few steps on a few stdlib modules."""
    from tests.train_fixtures import train_tiny_target

    return train_tiny_target(str(tmp_path_factory.mktemp("tiny_target")))
