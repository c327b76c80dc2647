"""Evaluation groups: hop counts for chain questions, kind and hops for the realistic world's other kinds."""

from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
from trace_jax.job.evaluate import group_of


def test_groups_split_the_realistic_kinds_and_keep_plain_hop_names():
    world = SyntheticWorld(
        WorldConfig(scale=2, questions_per_hop=20, buried_questions=10, buried_entity_fraction=0.2, trivial_questions=5)
    )
    groups = {group_of(row) for row in world.questions("train")}
    assert {"1-hop", "trivial/0-hop"} <= groups
    assert any(g.startswith("buried/") for g in groups)
    assert group_of({"question": "q", "data_source": "hotpotqa"}) == "hotpotqa"
