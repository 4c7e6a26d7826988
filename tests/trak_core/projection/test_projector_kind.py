"""The pipeline config names any registered projector: the kind is validated against the registry (not a fixed
list), and a kind registered at run time plans and featurizes like the built-in one it wraps."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError
from trak_fixtures import tiny_attribute_config

from examples import tiny
from tasks.config import AttributeConfig
from trak_core.projection.projectors import (
    DenseProjector,
    register_projector,
    registered_projectors,
    unregister_projector,
)
from trak_core.settings import TrakSettings
from trak_core.store import TrakStore


class _Renamed(DenseProjector):
    """The dense projection under another kind name (what a plugin registers)."""

    kind = "test_renamed_dense"


@pytest.fixture()
def ckpts(tmp_path):
    return tiny.save_checkpoints(tmp_path / "ck", seeds=(0,))


@pytest.fixture()
def renamed():
    register_projector("test_renamed_dense", _Renamed)
    yield "test_renamed_dense"
    unregister_projector("test_renamed_dense")


def test_a_registered_kind_is_accepted(tmp_path, ckpts, renamed):
    cfg = AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts, projector=renamed))
    assert cfg.projector == renamed and cfg.settings.projector == renamed
    assert TrakSettings(projector=renamed).projector == renamed


def test_an_unknown_kind_is_refused_listing_the_registered_ones(tmp_path, ckpts, renamed):
    with pytest.raises(ValidationError) as e:
        AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts, projector="no_such_kind"))
    msg = str(e.value)
    assert "projector" in msg and "'no_such_kind'" in msg
    for kind in registered_projectors():
        assert kind in msg
    assert renamed in msg and "factored" in msg


def test_the_kind_is_refused_once_unregistered(tmp_path, ckpts):
    register_projector("test_gone", _Renamed)
    AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts, projector="test_gone"))
    unregister_projector("test_gone")
    with pytest.raises(ValidationError, match="test_gone"):
        AttributeConfig.model_validate(tiny_attribute_config(tmp_path / "s", ckpts, projector="test_gone"))


def test_a_registered_kind_runs_the_pipeline_steps(tmp_path, ckpts, renamed):
    """Plan and featurize with the renamed kind: the store records it, and its rows equal the dense kind's."""
    from tasks import core

    rows = {}
    for kind in (renamed, "dense"):
        cfg = AttributeConfig.model_validate(tiny_attribute_config(tmp_path / kind, ckpts, projector=kind))
        plan = core.make_plan(cfg)
        core.featurize_shard(cfg, 0, plan.models[0].checkpoint, 0)
        st = TrakStore.open(cfg.store, mode="r")
        assert st.meta.projector == kind
        rows[kind] = st.model(0).grads[: plan.shard_rows]
    np.testing.assert_array_equal(rows[renamed], rows["dense"])


# ---------------------------------------------------------------------------- what the registry says of a kind
def test_the_registry_answers_what_a_kind_is():
    from trak_core.projection.projectors import ProjectorTraits, projector_traits

    assert projector_traits("noop") == ProjectorTraits(is_identity=True)
    assert projector_traits("factored") == ProjectorTraits(uses_model=True, splits_by_layer=True)
    assert projector_traits("dense") == ProjectorTraits() == projector_traits("sjlt")
    assert projector_traits("no_such_kind") == ProjectorTraits()  # a store written with a missing plugin


def test_a_kind_keeps_its_traits_on_every_device():
    from trak_core.errors import BadInputError
    from trak_core.projection.projectors import projector_traits

    register_projector("test_traits", _Renamed)
    try:
        with pytest.raises(BadInputError, match="'test_traits'.*differs from the kind's entries on other devices"):
            register_projector("test_traits", _Renamed, devices=["cuda"], is_identity=True)
        register_projector("test_traits", _Renamed, devices=["cuda"])  # the same traits: accepted
        assert not projector_traits("test_traits").is_identity
    finally:
        unregister_projector("test_traits")


def test_a_registered_identity_kind_gets_the_identity_rules(tmp_path, ckpts):
    """The rule "an identity keeps every coordinate: proj_dim ≥ n needs λ > 0" follows the registry's trait, not
    the name 'noop' (and a memory refusal names the kind)."""
    from tasks import core
    from trak_core.errors import BadInputError
    from trak_core.memory import check_task_memory, estimate_task_memory
    from trak_core.projection.projectors import NoOpProjector

    def identity(grad_dim, proj_dim, seed=0, proj_type="rademacher", device="cpu", **kwargs):
        return NoOpProjector(grad_dim=grad_dim, proj_dim=grad_dim, device=device)

    register_projector("test_identity", identity, is_identity=True)
    try:
        cfg = AttributeConfig.model_validate(
            tiny_attribute_config(tmp_path / "s", ckpts, projector="test_identity", lambda_reg=0.0)
        )
        with pytest.raises(BadInputError, match=r"^projector: 'test_identity' keeps all \d+ gradient dimensions"):
            core.make_plan(cfg)
        est = estimate_task_memory(
            train_set_size=100,
            grad_dim=11_700_000,
            proj_dim=11_700_000,
            num_params=11_700_000,
            batch_size=8,
            shard_rows=100,
            dtype_bytes=2,
            chunk_bytes=32 << 20,
        )
        with pytest.raises(BadInputError, match=r"^projector: .*'test_identity' keeps every gradient dimension"):
            check_task_memory(est, available=100 << 30, projector="test_identity")
    finally:
        unregister_projector("test_identity")
