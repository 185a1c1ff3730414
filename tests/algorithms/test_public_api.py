"""The public names the trainer and controller import."""


def test_public_api_imports():
    from rlax_tasks.algorithms import (  # noqa: F401
        ObjectiveConfig,
        filter_groups,
        make_objective,
        overlong_penalty,
    )

    obj = make_objective("dapo", eps_high=0.3)
    assert obj.config.eps_high == 0.3
    assert callable(obj.loss) and callable(obj.value_loss) and callable(obj.advantages)
