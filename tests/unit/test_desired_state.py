"""The desired state's served weights: one tagged field, read back from a record as written, and
from a record of the three fields it replaced (resume_state across an upgrade)."""

from __future__ import annotations

import pytest

from serve_app.desired_state import DesiredState, InitialWeights, ObjectStoreWeights, PathWeights, PeerWeights


@pytest.mark.parametrize("weights", [InitialWeights(), PathWeights(path="/w/v3"), ObjectStoreWeights(), PeerWeights()])
def test_each_kind_of_weights_reads_back_as_written(weights):
    state = DesiredState(weight_version=3, weights=weights, paused=True)
    assert DesiredState.model_validate_json(state.model_dump_json()) == state


@pytest.mark.parametrize(
    ("earlier", "weights"),
    [
        (
            {"weights_path": "/w/v3", "weights_in_object_store": False, "weights_from_peer": False},
            PathWeights(path="/w/v3"),
        ),
        ({"weights_path": None, "weights_in_object_store": True, "weights_from_peer": False}, ObjectStoreWeights()),
        ({"weights_path": None, "weights_in_object_store": False, "weights_from_peer": True}, PeerWeights()),
        ({"weights_path": None, "weights_in_object_store": False, "weights_from_peer": False}, InitialWeights()),
    ],
)
def test_a_record_of_the_three_earlier_fields_keeps_its_weights(earlier, weights):
    state = DesiredState.model_validate({"weight_version": 3, "paused": False, **earlier})
    assert state.weights == weights and state.weight_version == 3
