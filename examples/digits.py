"""The embedded default, :mod:`trakflow_demo_data.digits` (shipped with the package), under its former import path:
configs that name ``examples.digits:make_model`` and the like keep working from the checkout."""

from trakflow_demo_data.digits import (  # noqa: F401
    NUM_TARGETS,
    NUM_TRAIN,
    SPLIT_SEED,
    as_image,
    demo_configs,
    heldout_data,
    make_model,
    target_data,
    train_data,
    write_query_inputs,
)
